"""What a user would run at a memory budget without agoq, priced with the same cost model as the plans.

Alternatives, each with float32 AdamW or an 8-bit AdamW (both with float32 masters) and bf16 gradients, at every
micro-batch x accumulation split of the same global batch, in every compile mode the profile has step times for:

  bf16                         every layer unmodified, nothing recomputed (ChoiceProblem.evaluate of all-16)
  selective / full checkpointing  each layer kept whole or checkpointed, the fastest that fits
                               (costs.checkpointing_only solved for time by the MILP); full when every layer is
  torch.compile activation_memory_budget B   compiled only, measured: the profile's `compiled.memory_budget_points`
                               (step seconds and peak at the profiled micro-batch, measured with the profile's
                               optimizer; the peak is moved by the static bytes, the step by the optimizer step's
                               time, of each optimizer priced)

Compiled bf16 and compiled checkpointing use the compiled step and layer times with the eager memory model (the
partitioner may save a little less, so their predicted peaks are upper bounds). `best_alternative` is the one of
most tokens/s among those whose predicted peak fits the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from agoq.formats.profile import ProfileData
from agoq.search.costs import (
    ProblemSettings,
    build_problem,
    checkpointing_only,
    measured_with,
    mode_timing,
    state_parts,
    static_bytes_total,
)
from agoq.search.milp import InfeasibleBudget, Solver
from agoq.optim.state_bytes import step_bytes_moved

OPTIMIZERS = (("adamw", "fp32"), ("adamw8bit", "fp32"))
OPTIMIZER_NAMES = {"adamw": "AdamW", "adamw8bit": "8-bit AdamW"}


@dataclass
class PricedAlternative:
    """One alternative: its name, how it runs and its predicted step seconds, peak bytes and tokens/s."""

    name: str
    compile: str
    optimizer: str
    master: str
    micro_batch: int
    grad_accum: int
    step_seconds: float
    peak_bytes: int
    tokens_per_second: float
    fits: bool
    checkpoint_layers: list = field(default_factory=list)
    activation_memory_budget: Optional[float] = None

    def as_plan_field(self, plan_tokens_per_second: Optional[float] = None) -> dict:
        """The plan's `alternative` / `alternatives` entry (agoq.formats.plan.Alternative)."""
        out = {"name": self.name, "compile": self.compile,
               "optimizer": {"name": self.optimizer, "master": self.master}, "gradients": "bf16",
               "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
               "checkpoint_layers": list(self.checkpoint_layers),
               "activation_memory_budget": self.activation_memory_budget,
               "predicted": {"step_seconds": self.step_seconds, "peak_bytes": self.peak_bytes,
                             "tokens_per_second": self.tokens_per_second},
               "measured": None, "fits": self.fits}
        if plan_tokens_per_second and self.tokens_per_second > 0:
            out["speedup_predicted"] = plan_tokens_per_second / self.tokens_per_second
        return out


def _tokens(profile: ProfileData, mb: int, accum: int, seconds: float) -> float:
    return mb * accum * int(profile.settings.get("seq_len", 1) or 1) / seconds if seconds > 0 else 0.0


def _label(compile_mode: str, what: str, optimizer: str, mb: int, accum: int) -> str:
    split = f", micro-batch {mb} x {accum}" if accum > 1 else ""
    return f"{compile_mode} {what}, {OPTIMIZER_NAMES[optimizer]}{split}"


def price_alternatives(profile: ProfileData, budget: float, splits: list[tuple[int, int]],
                       compile_modes: list[str]) -> list[PricedAlternative]:
    """Every alternative of the module docstring at `budget` bytes (largest stage), for each (micro_batch,
    grad_accum) of `splits` and each compile mode; priced with bf16 gradients."""
    out: list[PricedAlternative] = []
    profiled = int(profile.settings.get("micro_batch", 1) or 1)
    for compile_mode in compile_modes:
        for mb, accum in splits:
            for optimizer, master in OPTIMIZERS:
                knobs = ProblemSettings(gradient_mode="bf16", optimizer=optimizer, master=master,
                                        compile_mode=compile_mode, micro_batch=mb, grad_accum=accum)
                try:
                    problem = build_problem(profile, knobs)
                except ValueError:
                    continue
                L = problem.num_layers
                sixteen = np.nonzero(problem.keeps_16bit())[0]
                bf16 = problem.evaluate(sixteen, np.zeros(L, dtype=bool))
                peak = max(bf16["peak_bytes_per_stage"])
                out.append(PricedAlternative(_label(compile_mode, "bf16", optimizer, mb, accum), compile_mode,
                                             optimizer, master, mb, accum, bf16["step_seconds"], peak,
                                             _tokens(profile, mb, accum, bf16["step_seconds"]), peak <= budget))
                if problem.allow_checkpoint:
                    ckpt_problem = checkpointing_only(problem)
                    try:
                        alloc = Solver(ckpt_problem).solve(budget, "time")
                        ckpt, figures = alloc.checkpoint, {"step_seconds": alloc.step_seconds,
                                                           "peak_bytes_per_stage": alloc.peak_bytes_per_stage}
                    except InfeasibleBudget:
                        ckpt = np.ones(L, dtype=bool)
                        figures = ckpt_problem.evaluate(np.array([], dtype=int), ckpt)
                    n = int(ckpt.sum())
                    if n:  # none checkpointed is the bf16 entry
                        what = "full checkpointing" if n == L else f"selective checkpointing ({n}/{L} layers)"
                        peak = max(figures["peak_bytes_per_stage"])
                        out.append(PricedAlternative(_label(compile_mode, what, optimizer, mb, accum), compile_mode,
                                                     optimizer, master, mb, accum, figures["step_seconds"], peak,
                                                     _tokens(profile, mb, accum, figures["step_seconds"]),
                                                     peak <= budget, [int(i) for i in np.nonzero(ckpt)[0]]))
                if compile_mode == "compiled" and (mb, accum) == (profiled, 1):
                    out += _memory_budget_points(profile, budget, optimizer, master)
    return out


def _memory_budget_points(profile: ProfileData, budget: float, optimizer: str, master: str) -> list:
    """The profile's measured torch.compile activation_memory_budget points, moved to `optimizer`'s state."""
    section = profile.header.get("compiled") or {}
    points = section.get("memory_budget_points") or []
    if not points:
        return []
    base = measured_with(profile)
    timing = mode_timing(profile, "compiled")
    moved = step_bytes_moved(optimizer, master, "bf16") / step_bytes_moved(base["optimizer"], base["master"],
                                                                            base["gradients"])
    static = static_bytes_total(profile, "bf16", optimizer, master) \
        - static_bytes_total(profile, "bf16", base["optimizer"], base["master"])
    transient = state_parts(profile, "bf16", optimizer, master)["step_transient"] \
        - state_parts(profile, "bf16", base["optimizer"], base["master"])["step_transient"]
    mb = int(profile.settings.get("micro_batch", 1) or 1)
    out = []
    for point in points:
        if point.get("step_seconds") is None or point.get("peak_bytes") is None:
            continue
        b = float(point["activation_memory_budget"])
        seconds = float(point["step_seconds"]) + timing["optimizer"] * (moved - 1.0)
        fb_peak = float(point.get("peak_bytes_forward_backward") or point["peak_bytes"]) + static
        opt_peak = float(point.get("peak_bytes_optimizer_step") or 0) + static + transient
        peak = int(max(fb_peak, opt_peak))
        out.append(PricedAlternative(_label("compiled", f"activation_memory_budget {b:g}", optimizer, mb, 1),
                                     "compiled", optimizer, master, mb, 1, seconds, peak,
                                     _tokens(profile, mb, 1, seconds), peak <= budget,
                                     activation_memory_budget=b))
    return out


def best_alternative(alternatives: list[PricedAlternative]) -> Optional[PricedAlternative]:
    """The fitting alternative of most tokens/s (ties: the smaller peak); None when none fits."""
    fitting = [a for a in alternatives if a.fits]
    return min(fitting, key=lambda a: (-a.tokens_per_second, a.peak_bytes)) if fitting else None


__all__ = ["PricedAlternative", "price_alternatives", "best_alternative"]
