"""Validation: run plans for real (a few training steps on random tokens of the profiled model) and measure
peak memory, step time and loss deviation from plain bf16 training; in this process or as Ray tasks.

Peak memory is `torch.cuda.max_memory_allocated` over the steps (weights, float32 masters, gradients, AdamW
state and activations: what the plan's predicted peak counts; the steps train as `agoq train` does); on a CPU
it is not measured and recorded as None.
Gradients are kept in bf16 here whatever the plan's gradient mode (a single process has no all-reduce).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, Optional, Sequence

from agoq.formats.plan import plan_from_dict
from agoq.progress import progress_bar
from agoq.units import dtype_from_name


def now() -> str:
    """The current UTC time, ISO 8601, to the second."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")




def measure_plan(plan: Optional[dict], model_config: dict, *, dtype: str = "bf16", micro_batch: int = 1,
                 seq_len: int = 64, grad_accum: int = 1, steps: int = 4, seed: int = 0,
                 device: Optional[str] = None, lr: float = 1e-4, optimizer: Optional[str] = None,
                 master: Optional[str] = None, gradients: Optional[str] = None,
                 compile_mode: Optional[str] = None) -> dict[str, Any]:
    """Train `steps` optimizer steps of the model (`model_config`, a LlamaConfig dict) with `plan` applied (None:
    plain model) on random tokens, as `agoq train` would: the plan's optimizer and masters (torch's AdamW on float32
    masters, or the fused 8-bit AdamW), its gradient storage (bf16 .grad or QuanGrad's 8-bit buffer) and compile
    mode (each decoder layer torch.compile'd); `optimizer`, `master`, `gradients` and `compile_mode` override the
    plan's (and apply without one). Returns peak bytes (None on CPU), median step seconds (first step excluded),
    the losses and the device."""
    import torch

    from agoq.models import build
    from agoq.optim.master_weights import MasterWeights

    spec = plan_from_dict(plan) if plan is not None else None
    optimizer = optimizer or (spec.optimizer.name if spec else "adamw")
    master = master or (spec.optimizer.master if spec else "fp32")
    gradients = gradients or (spec.gradients.mode if spec else "bf16")
    compile_mode = compile_mode or (spec.training.compile if spec else "eager")
    if gradients not in ("bf16", "quangrad8"):
        raise ValueError(f"measuring a plan runs one process: gradients bf16 or quangrad8, not {gradients!r}")
    torch_dtype = dtype_from_name(dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    gc.collect()  # an earlier model under checkpointing or LAAQ sits in reference cycles: free it first
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build(dict(model_config), dtype=torch_dtype, device=device, seed=seed)
    if spec is not None:
        spec.apply(model)
    if compile_mode == "compiled":
        from agoq.activations.compile import compile_decoder_layers

        compile_decoder_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    qgrads = None
    if gradients == "quangrad8":
        from agoq.comm.quangrad import QuantizedGradients

        qgrads = QuantizedGradients(params)
    if optimizer == "adamw8bit":
        from agoq.optim.adamw8bit import FusedAdamW8bit

        opt = FusedAdamW8bit(params, lr=lr, masters=master == "fp32", seed=seed)

        def step() -> None:
            opt.step(grads=qgrads)

        def zero() -> None:
            for p in params:
                p.grad = None
            if qgrads is not None:
                qgrads.zero_()
    else:
        if master != "fp32":
            raise ValueError("masters 'none' needs the adamw8bit optimizer")
        weights = MasterWeights(params)  # agoq train's numerics
        opt = torch.optim.AdamW(weights.targets, lr=lr)

        def step() -> None:
            if qgrads is not None:
                weights.step(opt, [qgrads.gradient(p) for p in params])
            else:
                weights.step(opt)

        def zero() -> None:
            weights.zero_grad()
            if qgrads is not None:
                qgrads.zero_()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (micro_batch, seq_len + 1), device=device, generator=gen)
               for _ in range(steps * grad_accum)]
    losses, times = [], []
    for i in range(steps):
        if cuda:
            torch.cuda.synchronize(device)
            if i == 1:  # after the warm-up step: gradients and optimizer state are allocated, as planned
                torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        zero()  # gradients are dropped between steps, as agoq train does
        total = 0.0
        for a in range(grad_accum):
            ids = batches[i * grad_accum + a]
            loss = model(ids[:, :-1], ids[:, 1:]) / grad_accum
            loss.backward()
            total += float(loss.detach())
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(total)
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    if qgrads is not None:
        qgrads.remove()
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    timed = times[1:] if len(times) > 1 else times
    return {"peak_bytes": peak, "step_seconds": statistics.median(timed), "losses": losses, "device": device}


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


def validate_plans(plans: list, model_config: dict, *, dtype: str = "bf16", steps: int = 4, seed: int = 0,
                   runner: Optional[Runner] = None, device: Optional[str] = None, progress: bool = True) -> list[dict]:
    """Measure each plan (agoq.formats.plan.Plan) and plain bf16 training of the same model, batch and data; writes
    `measured` into each plan and returns the measured dicts (a progress bar with `progress`)."""
    runner = runner or Runner()
    # one process measures each plan: SDP4Bit's sharded gradients (several processes) are measured as bf16 .grad
    jobs = [dict(plan=None if p is None else p.to_dict(), model_config=model_config, dtype=dtype,
                 micro_batch=p.training.micro_batch, seq_len=p.training.seq_len, grad_accum=p.training.grad_accum,
                 steps=steps, seed=seed, device=device, gradients="bf16" if p.gradients.mode == "sdp4bit" else None)
            for p in plans]
    shapes = {(j["micro_batch"], j["seq_len"], j["grad_accum"]) for j in jobs}
    refs = [dict(plan=None, model_config=model_config, dtype=dtype, micro_batch=mb, seq_len=sl, grad_accum=ga,
                 steps=steps, seed=seed, device=device, gradients=None) for mb, sl, ga in sorted(shapes)]
    results = runner.map(measure_plan, jobs + refs, progress="validating plans" if progress else None)
    reference = {(j["micro_batch"], j["seq_len"], j["grad_accum"]): r for j, r in zip(refs, results[len(jobs):])}
    measured = []
    for plan, job, r in zip(plans, jobs, results[:len(jobs)]):
        ref = reference[(job["micro_batch"], job["seq_len"], job["grad_accum"])]
        stages = plan.pipeline.stages
        entry = {"peak_bytes_per_stage": [r["peak_bytes"]] + [None] * (stages - 1),
                 "step_seconds": r["step_seconds"], "loss_deviation": loss_deviation(r["losses"], ref["losses"]),
                 "date": now(), "device": r["device"], "steps": steps,
                 "bf16_step_seconds": ref["step_seconds"], "bf16_peak_bytes": ref["peak_bytes"]}
        if r["peak_bytes"] is None:
            entry["note"] = "peak memory not measured on a CPU"
        if stages > 1:
            entry["note"] = "the whole model ran in one process: the peak is not per pipeline stage"
            entry["peak_bytes_per_stage"] = [None] * stages
            entry["whole_model_peak_bytes"] = r["peak_bytes"]
        if plan.gradients.mode == "sdp4bit":
            entry["gradients"] = ("measured with bf16 gradients in one process: SDP4Bit's sharded step needs several "
                                  "processes")
        plan.measured = entry
        measured.append(entry)
    return measured
