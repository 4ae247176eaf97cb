"""Measuring training steps: `agoq train`'s own run, in this process, with no run folder.

`measure_steps(cfg)` prepares the run as `agoq train` does (`agoq.train.preparation.prepare`: the plan or policy
met with the settings, the model built, the plan applied by `agoq.train.apply.apply_plan`) and runs
`cfg.loop.steps` optimizer steps through `Trainer.step`: the same forward, backward, accumulation, gradient
reduction, clipping and optimizer step, the same seed, data order and learning rate schedule. Nothing is written
(no run folder, checkpoint or evaluation). Without `data` the steps read the built-in synthetic corpus.

Peak bytes are the GPU's allocated bytes during each step (`torch.cuda.max_memory_allocated`, reset as the step
begins: the weights, master copies, gradients, optimizer state and activations), not measured on a CPU (None). A
run must survive every step, and the first one (which allocates the gradients and the optimizer state) can hold
more than the later ones: the figures give the first step's peak and the largest of any step. Step time is the
median over the steps after the first (warm-up: compilation, first allocations).

`measure_plan(plan, model_config, ...)` is the measurement `agoq search --validate` and `--measure-trials` run
(agoq.commands.search hands it to the search): a plan's JSON data as one process runs it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional

import torch

from agoq.formats.plan import Plan, new_plan, plan_from_dict
from agoq.train import collector
from agoq.train.config import JobConfig, TrainConfig
from agoq.train.parallel import World
from agoq.train.preparation import prepare
from agoq.train.trainer import Trainer
from agoq.vocabulary import COMPILED


@dataclass(frozen=True)
class StepFigures:
    """What `measure_steps` measured, one entry per optimizer step (the first included)."""

    losses: list[float]
    seconds: list[float]
    peak_bytes: Optional[list[int]]  # None: not measured (a CPU)
    device: str  # as asked (e.g. "cuda:1"), else "cuda" or "cpu"
    offloaded_bytes: Optional[int] = None  # bytes the offloaded layers kept in host memory per micro-batch (None:
                                           # nothing offloaded)

    @property
    def first_peak_bytes(self) -> Optional[int]:
        """The first step's peak (it allocates the gradients and the optimizer state)."""
        return self.peak_bytes[0] if self.peak_bytes else None

    @property
    def max_peak_bytes(self) -> Optional[int]:
        """The largest peak of any step: what a run must have room for."""
        return max(self.peak_bytes) if self.peak_bytes else None

    @property
    def median_seconds(self) -> float:
        """The median step time after warm-up (the first step excluded, unless it is the only one)."""
        return statistics.median(self.seconds[1:] or self.seconds)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: `peak_bytes` (the largest step's), `first_step_peak_bytes`, `step_seconds` (the median after
        warm-up), each step's `peak_bytes_per_step` and `seconds_per_step`, the `losses`, the `device` and the
        `offloaded_bytes` per micro-batch (null: nothing offloaded)."""
        return {"peak_bytes": self.max_peak_bytes, "first_step_peak_bytes": self.first_peak_bytes,
                "step_seconds": self.median_seconds, "peak_bytes_per_step": self.peak_bytes,
                "seconds_per_step": list(self.seconds), "losses": list(self.losses), "device": self.device,
                "offloaded_bytes": self.offloaded_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepFigures":
        """The figures `to_dict` wrote (its summaries are derived, not read); KeyError / TypeError / ValueError on a
        dict it did not write."""
        return cls(losses=list(d["losses"]), seconds=[float(t) for t in d["seconds_per_step"]],
                   peak_bytes=d["peak_bytes_per_step"], device=str(d["device"]),
                   offloaded_bytes=d.get("offloaded_bytes"))


def _release_memory() -> None:
    torch._dynamo.reset()  # compiled layers' code caches hold their modules: dropped before the collection
    collector.collect()  # a model under checkpointing or LAAQ sits in reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_steps(cfg: JobConfig, world: Optional[World] = None) -> StepFigures:
    """Run `cfg.loop.steps` optimizer steps of the run `cfg` describes, as `agoq train` runs them, in this process
    (one process: a plan or layout that needs several is refused as `agoq train` refuses it), or with `world` (a
    process group every rank of which calls this with the same `cfg`) on all its ranks, each step's peak then the
    largest of any rank's. ValueError for settings `agoq train` refuses; TrainingFailed when a step's loss or
    gradient norm is not finite."""
    _release_memory()  # what an earlier measurement left
    # what was allocated before this run (another measurement's leftovers, the caller's tensors): not its peak
    cuda = torch.cuda.is_available() and (cfg.model.device or "cuda").startswith("cuda")
    before = torch.cuda.memory_allocated(torch.device(cfg.model.device or "cuda")) if cuda else 0
    trainer = Trainer(prepare(cfg, world if world is not None else World()))
    device = trainer.device
    offloaded = None
    try:
        results = [trainer.step(step) for step in range(cfg.loop.steps)]
        if trainer.prepared.offload is not None:
            offloaded = sum(trainer.prepared.offload.stats.bytes_per_layer.values())
    finally:
        trainer.close()
        trainer.parallel.release()
        del trainer
        _release_memory()
    # every rank's peak of a step (one entry in one process): the largest
    peaks = [max(r.peak_bytes) - before for r in results] if device.type == "cuda" else None
    return StepFigures([r.loss for r in results], [r.seconds for r in results], peaks, cfg.model.device or device.type,
                       offloaded)


def one_process_plan(plan: dict, *, micro_batch: int, seq_len: int, grad_accum: int, optimizer: Optional[str] = None,
                     master: Optional[str] = None, gradients: Optional[str] = None,
                     compile: Optional[str] = None) -> Plan:
    """`plan` (JSON data) as one process runs it: every layer on one stage and no `parallel` dims or `launch` (the
    whole model here, whatever layout it was searched for), no budget or predictions to hold it to, the batch shape
    given, and the optimizer, masters, gradient storage and `compile` (agoq.vocabulary.COMPILE_MODES: "eager" /
    "compiled", as the plan's `training.compile`) stated: the given ones, else the plan's."""
    spec = plan_from_dict(plan)
    data = spec.to_dict()
    for name in ("launch", "parallel", "schema", "model", "layers"):
        data.pop(name, None)
    data.update(budget_bytes=None, measured=None,
                pipeline={**data["pipeline"], "stages": 1, "micro_batches": 1},
                predicted={**data["predicted"], "peak_bytes_per_stage": [], "activation_bytes_per_stage": []},
                gradients={**data["gradients"], "mode": gradients or spec.gradients.mode},
                optimizer={"name": optimizer or spec.optimizer.name, "master": master or spec.optimizer.master},
                training={**data["training"], "micro_batch": micro_batch, "seq_len": seq_len,
                          "grad_accum": grad_accum, "compile": compile or spec.training.compile})
    return new_plan(spec.model, [{**lp.model_dump(mode="json"), "stage": 0} for lp in spec.layers],
                    "the plan as one process runs it", **data)


def measure_plan(plan: Optional[dict], model_config: dict, *, dtype: str = "bf16", micro_batch: int = 1,
                 seq_len: int = 64, grad_accum: int = 1, steps: int = 4, seed: int = 0,
                 device: Optional[str] = None, lr: float = 1e-4, optimizer: Optional[str] = None,
                 master: Optional[str] = None, gradients: Optional[str] = None,
                 compile: Optional[str] = None) -> dict[str, Any]:
    """Train `steps` optimizer steps of the model (`model_config`, a LlamaConfig dict) with `plan` (JSON data;
    None: the plain model) in this process, on the built-in synthetic corpus, with `agoq train`'s step: the plan
    as one process runs it (`one_process_plan`: its optimizer and masters, gradient storage and compile mode;
    `optimizer`, `master`, `gradients` and `compile` ("eager" / "compiled") replace the plan's, and apply without one: AdamW on
    float32 masters, bf16 gradients, eager). Returns `StepFigures.to_dict()`: peak bytes (None on a CPU), the
    median step seconds after warm-up, the losses and the device."""
    common = dict(model=dict(model_config), dtype=dtype, steps=steps, seed=seed, device=device, lr=lr, quiet=True)
    if plan is None:
        cfg = TrainConfig(**common, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                          gradients=gradients or "bf16", optimizer=optimizer or "adamw", master=master or "fp32",
                          compile=compile == COMPILED)
    else:
        cfg = TrainConfig(**common, plan=one_process_plan(plan, micro_batch=micro_batch, seq_len=seq_len,
                                                          grad_accum=grad_accum, optimizer=optimizer, master=master,
                                                          gradients=gradients, compile=compile))
    return measure_steps(cfg).to_dict()


__all__ = ["measure_steps", "measure_plan", "one_process_plan", "StepFigures"]
