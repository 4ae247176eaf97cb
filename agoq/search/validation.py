"""Validation: run plans for real (a few training steps of the profiled model) and record their peak memory, step
time and loss deviation from plain bf16 training; in this process or as Ray tasks.

The search does not train: what runs a plan is given to it (`measure`; `agoq search` hands it
agoq.train.measure.measure_plan, `agoq train`'s own step on its built-in synthetic corpus). measure(plan=JSON
data or None for plain bf16, model_config=..., dtype=..., micro_batch=..., seq_len=..., grad_accum=..., steps=...,
seed=..., device=..., gradients=...) returns {"peak_bytes": the largest step's (None where not measured, e.g. on
a CPU), "first_step_peak_bytes", "step_seconds": the median after warm-up, "losses": [...], "device"}.
A plan runs in one process: its pipeline stages as one model, FSDP2's TLq-HS gradients (several processes) as
bf16 .grad, each said in the measured figures.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from agoq.progress import progress_bar


def now() -> str:
    """The current UTC time, ISO 8601, to the second."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def loss_deviation(losses: Sequence[float], reference: Sequence[float]) -> float:
    """Mean relative deviation |loss - reference| / |reference| over the steps."""
    pairs = [(a, b) for a, b in zip(losses, reference)]
    if not pairs:
        return float("nan")
    return sum(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) / len(pairs)


class Runner:
    """Runs measurement functions here (address None) or as Ray tasks ("local" starts a Ray instance on
    this machine; any other address joins that cluster). Ray is imported only when used."""

    def __init__(self, ray_address: Optional[str] = None):
        self.ray = None
        if ray_address is not None:
            try:
                import ray
            except ImportError as e:
                raise ValueError("--ray-address needs the ray package (pip install ray)") from e
            if not ray.is_initialized():
                kwargs = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
                if ray_address == "local":
                    ray.init(num_cpus=None, **kwargs)
                else:
                    ray.init(address=ray_address, **kwargs)
            self.ray = ray

    def map(self, fn: Callable, jobs: Sequence[dict], progress: Optional[str] = None) -> list:
        """fn(**job) for every job, in order; in parallel on Ray."""
        bar = None
        if progress:
            bar = progress_bar(total=len(jobs), desc=progress, unit="run")
        if self.ray is None:
            out = []
            for job in jobs:
                out.append(fn(**job))
                if bar:
                    bar.update(1)
        else:
            ray = self.ray
            gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
            remote = ray.remote(num_gpus=gpus)(fn)
            refs = [remote.remote(**job) for job in jobs]
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                if bar:
                    bar.update(len(done))
            out = ray.get(refs)
        if bar:
            bar.close()
        return out


def validate_plans(plans: list, model_config: dict, *, measure: Callable, dtype: str = "bf16", steps: int = 4,
                   seed: int = 0, runner: Optional[Runner] = None, device: Optional[str] = None,
                   progress: bool = True) -> list[dict]:
    """Measure each plan (agoq.formats.plan.Plan) and plain bf16 training of the same model, batch and data with
    `measure` (see the module docstring); writes `measured` into each plan and returns the measured dicts (a
    progress bar with `progress`)."""
    runner = runner or Runner()
    # one process measures each plan: TLq-HS's sharded gradients (several processes) are measured as bf16 .grad
    jobs = [dict(plan=None if p is None else p.to_dict(), model_config=model_config, dtype=dtype,
                 micro_batch=p.training.micro_batch, seq_len=p.training.seq_len, grad_accum=p.training.grad_accum,
                 steps=steps, seed=seed, device=device, gradients="bf16" if p.gradients.mode == "sdp4bit" else None)
            for p in plans]
    shapes = {(j["micro_batch"], j["seq_len"], j["grad_accum"]) for j in jobs}
    refs = [dict(plan=None, model_config=model_config, dtype=dtype, micro_batch=mb, seq_len=sl, grad_accum=ga,
                 steps=steps, seed=seed, device=device, gradients=None) for mb, sl, ga in sorted(shapes)]
    results = runner.map(measure, jobs + refs, progress="validating plans" if progress else None)
    reference = {(j["micro_batch"], j["seq_len"], j["grad_accum"]): r for j, r in zip(refs, results[len(jobs):])}
    measured = []
    for plan, job, r in zip(plans, jobs, results[:len(jobs)]):
        ref = reference[(job["micro_batch"], job["seq_len"], job["grad_accum"])]
        stages = plan.pipeline.stages
        entry = {"peak_bytes_per_stage": [r["peak_bytes"]] + [None] * (stages - 1),
                 "step_seconds": r["step_seconds"], "loss_deviation": loss_deviation(r["losses"], ref["losses"]),
                 "date": now(), "device": r["device"], "steps": steps,
                 "first_step_peak_bytes": r.get("first_step_peak_bytes"),
                 "bf16_step_seconds": ref["step_seconds"], "bf16_peak_bytes": ref["peak_bytes"]}
        if r["peak_bytes"] is None:
            entry["note"] = "peak memory not measured on a CPU"
        if stages > 1:
            entry["note"] = "the whole model ran in one process: the peak is not per pipeline stage"
            entry["peak_bytes_per_stage"] = [None] * stages
            entry["whole_model_peak_bytes"] = r["peak_bytes"]
        if plan.gradients.mode == "sdp4bit":
            entry["gradients"] = ("measured with bf16 gradients in one process: TLq-HS under FSDP2 needs several "
                                  "processes")
        plan.measured = entry
        measured.append(entry)
    return measured
