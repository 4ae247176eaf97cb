"""What a user would run at a memory budget without agoq, priced with the same cost model as the plans.

Alternatives, each with float32 AdamW or an 8-bit AdamW (both with float32 masters; where the search may drop masters,
also the 8-bit AdamW updating bf16 parameters in place, as torchao's and bitsandbytes' 8-bit optimizers are most
often run) and bf16 gradients, at every micro-batch x accumulation split of the same global batch, in every compile
mode the profile has step times for:

  bf16                         every layer unmodified, nothing recomputed (ChoiceProblem.evaluate of all-16)
  selective / full checkpointing  each layer kept whole or checkpointed, the fastest that fits
                               (costs.checkpointing_only solved for time by the MILP); full when every layer is
  bf16 + offload K layers      where the profile measured the host link: every layer unmodified, the first K layers'
                               bf16 activations kept in pinned host memory (side-stream copies, prefetched in
                               backward: ordinary offload, as torchtune's or TransformerEngine's), the least K
                               that fits, priced by the same offload model as plans (agoq.search.problem.OffloadPrices)
  full checkpointing + inputs offloaded K layers   where full checkpointing does not fit: the first K checkpointed
                               layers' inputs (all a checkpointed layer keeps) in host memory the same way, the least
                               K that fits (the ordinary offload of checkpointed inputs; compile's
                               activation_memory_budget with offload keeps about as little)
  torch.compile activation_memory_budget B   compiled only, measured: the profile's measured steps under a
                               budget (agoq.search.timing; step seconds and peak at their split and optimizer; the
                               peak is moved by the state's bytes, the step by what the optimizer was measured to
                               add, for each optimizer priced)

bf16 and checkpointing are priced by the same cost model as plans (agoq.search.costs, calibrated on the profile's
measured peaks: agoq.search.calibration), so a plan and its alternatives are compared on one footing.
`best_alternative` is the one of most tokens/s among those whose predicted peak fits the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from agoq.formats.profile import ProfileData
from agoq.search.calibration import margin
from agoq.search.costs import ProblemSettings, build_problem, checkpointing_only, state_parts, static_bytes_total
from agoq.search.milp import InfeasibleBudget, Solver
from agoq.search.timing import prices

OPTIMIZERS = (("adamw", "fp32"), ("adamw8bit", "fp32"))
WITHOUT_MASTERS = ("adamw8bit", "none")  # offered where the search's knob space has masters "none"
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
    offload_layers: list = field(default_factory=list)  # layers whose activations are kept in host memory
    activation_bytes_per_stage: Optional[list] = None  # what the layers keep (None: not modelled, compile's budget)
    memory_per_stage: Optional[list] = None            # the peak's parts (agoq.search.memory_parts; None: measured)
    host_bytes: Optional[int] = None                   # with offloaded layers: what they keep on the host per micro-batch
    offload_link_seconds: Optional[float] = None       # and the host link's seconds per step, out and back

    def as_plan_field(self, plan_tokens_per_second: Optional[float] = None) -> dict:
        """The plan's `alternative` / `alternatives` entry (agoq.formats.plan.Alternative)."""
        out = {"name": self.name, "compile": self.compile,
               "optimizer": {"name": self.optimizer, "master": self.master}, "gradients": "bf16",
               "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
               "checkpoint_layers": list(self.checkpoint_layers), "offload_layers": list(self.offload_layers),
               "activation_memory_budget": self.activation_memory_budget,
               "predicted": {"step_seconds": self.step_seconds, "peak_bytes": self.peak_bytes,
                             "tokens_per_second": self.tokens_per_second,
                             **({"activation_bytes_per_stage": self.activation_bytes_per_stage,
                                 "memory_per_stage": self.memory_per_stage}
                                if self.activation_bytes_per_stage is not None else {}),
                             **({"host_bytes": self.host_bytes, "offload_link_seconds": self.offload_link_seconds}
                                if self.host_bytes is not None else {})},
               "measured": None, "fits": self.fits}
        if plan_tokens_per_second and self.tokens_per_second > 0:
            out["speedup_predicted"] = plan_tokens_per_second / self.tokens_per_second
        return out


def _tokens(profile: ProfileData, mb: int, accum: int, seconds: float) -> float:
    return mb * accum * int(profile.settings.get("seq_len", 1) or 1) / seconds if seconds > 0 else 0.0


def _label(compile_mode: str, what: str, optimizer: str, mb: int, accum: int, master: str = "fp32") -> str:
    split = f", micro-batch {mb} x {accum}" if accum > 1 else ""
    masters = " without masters" if master == "none" else ""
    return f"{compile_mode} {what}, {OPTIMIZER_NAMES[optimizer]}{masters}{split}"


def price_alternatives(profile: ProfileData, budget: float, splits: list[tuple[int, int]],
                       compile_modes: list[str], *, offload: bool = True,
                       host_budget: Optional[float] = None, masters=("fp32",)) -> list[PricedAlternative]:
    """Every alternative of the module docstring at `budget` bytes (largest stage), for each (micro_batch,
    grad_accum) of `splits` and each compile mode; priced with bf16 gradients (`offload` False: none offloads;
    `host_budget`: bytes offload may pin, None the profile's pinnable bytes; `masters`: those the search may
    choose, "none" adding the 8-bit AdamW without masters)."""
    optimizers = OPTIMIZERS + ((WITHOUT_MASTERS,) if "none" in masters else ())
    out: list[PricedAlternative] = []
    for compile_mode in compile_modes:
        for mb, accum in splits:
            for optimizer, master in optimizers:
                knobs = ProblemSettings(gradient_mode="bf16", optimizer=optimizer, master=master,
                                        compile_mode=compile_mode, micro_batch=mb, grad_accum=accum,
                                        allow_offload=offload, host_budget=host_budget)
                try:
                    problem = build_problem(profile, knobs)
                except ValueError:
                    continue
                L = problem.num_layers
                sixteen = np.nonzero(problem.keeps_16bit())[0]
                none = np.zeros(L, dtype=bool)
                bf16 = problem.evaluate(sixteen, none)
                peak = max(bf16["peak_bytes_per_stage"])
                out.append(PricedAlternative(_label(compile_mode, "bf16", optimizer, mb, accum, master), compile_mode,
                                             optimizer, master, mb, accum, bf16["step_seconds"], peak,
                                             _tokens(profile, mb, accum, bf16["step_seconds"]), peak <= budget,
                                             activation_bytes_per_stage=bf16["activation_bytes_per_stage"],
                                             memory_per_stage=_parts(problem, sixteen, none)))
                if problem.offload is not None and peak > budget:
                    out += _offload_alternative(problem, profile, budget, compile_mode, optimizer, master, mb, accum,
                                                sixteen, none, "bf16")
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
                        kept = np.array([i for i in sixteen if not ckpt[problem.layer[i]]], dtype=int)
                        figures = problem.evaluate(kept, ckpt)
                        peak = max(figures["peak_bytes_per_stage"])
                        out.append(PricedAlternative(_label(compile_mode, what, optimizer, mb, accum, master),
                                                     compile_mode,
                                                     optimizer, master, mb, accum, figures["step_seconds"], peak,
                                                     _tokens(profile, mb, accum, figures["step_seconds"]),
                                                     peak <= budget, [int(i) for i in np.nonzero(ckpt)[0]],
                                                     activation_bytes_per_stage=figures["activation_bytes_per_stage"],
                                                     memory_per_stage=_parts(problem, kept, ckpt)))
                        if n == L and peak > budget and problem.offload is not None:
                            out += _offload_alternative(problem, profile, budget, compile_mode, optimizer, master,
                                                        mb, accum, kept, ckpt, "full checkpointing",
                                                        offloaded="inputs offloaded")
    if "compiled" in compile_modes:
        for optimizer, master in optimizers:
            out += _memory_budget_points(profile, budget, optimizer, master)
    return out


def _offload_alternative(problem, profile: ProfileData, budget: float, compile_mode: str, optimizer: str,
                         master: str, mb: int, accum: int, kept: np.ndarray, checkpoint: np.ndarray, what: str, *,
                         offloaded: str = "offload") -> list:
    """`what` (options `kept`, layers `checkpoint` checkpointed) with the first K layers' saved tensors in host
    memory, the least K that fits `budget` within the host budget ([] when none does)."""
    L = problem.num_layers
    for k in range(1, L + 1):
        offload = np.arange(L) < k
        figures = problem.evaluate(kept, checkpoint, offload)
        if figures["host_bytes"] > problem.offload.host_budget_bytes:
            return []
        peak = max(figures["peak_bytes_per_stage"])
        if peak <= budget:
            seconds = figures["step_seconds"]
            return [PricedAlternative(_label(compile_mode, f"{what} + {offloaded} {k}/{L} layers", optimizer, mb,
                                             accum, master),
                                      compile_mode, optimizer, master, mb, accum, seconds, peak,
                                      _tokens(profile, mb, accum, seconds), True,
                                      [int(i) for i in np.nonzero(checkpoint)[0]], offload_layers=list(range(k)),
                                      activation_bytes_per_stage=figures["activation_bytes_per_stage"],
                                      memory_per_stage=_parts(problem, kept, checkpoint, offload),
                                      host_bytes=int(figures["host_bytes"]),
                                      offload_link_seconds=float(figures["offload_link_seconds"])
                                      * problem.offload.grad_accum)]
    return []


def _parts(problem, chosen: np.ndarray, checkpoint: np.ndarray, offload=None) -> Optional[list]:
    """The peak's parts of a choice (agoq.search.memory_parts), None where the problem does not list them."""
    try:
        return problem.memory_parts(chosen, checkpoint, offload)
    except ValueError:
        return None


def _memory_budget_points(profile: ProfileData, budget: float, optimizer: str, master: str) -> list:
    """The profile's measured torch.compile activation_memory_budget steps (agoq.search.timing), moved to
    `optimizer`'s state: the step by what the optimizer was measured to add (none where it was not), the peak by
    the state's bytes (and the optimizer step's transient), plus the compiled peak margin (agoq.search.calibration)."""
    sp = prices(profile)
    base = sp.base("compiled")
    out = []
    for row in sp.memory_budget_rows():
        if row.get("peak_bytes") is None:
            continue
        seconds = sp.price(row)
        if (optimizer, master) != (row["optimizer"], row["master"]):
            theirs = sp.seconds("compiled", sp.m0, 1, "bf16", optimizer, master)
            ours = sp.seconds("compiled", sp.m0, 1, "bf16", row["optimizer"], row["master"])
            if theirs is None or ours is None or base is None:
                continue
            seconds += theirs - ours
        static = static_bytes_total(profile, "bf16", optimizer, master) \
            - static_bytes_total(profile, "bf16", row["optimizer"], row["master"])
        transient = state_parts(profile, "bf16", optimizer, master)["step_transient"] \
            - state_parts(profile, "bf16", row["optimizer"], row["master"])["step_transient"]
        peak = int(float(row["peak_bytes"]) + static + max(0.0, transient) + margin(profile, "compiled")[0])
        b = float(row["activation_memory_budget"])
        mb, accum = row["micro_batch"], row["grad_accum"]
        out.append(PricedAlternative(_label("compiled", f"activation_memory_budget {b:g}", optimizer, mb, accum,
                                            master),
                                     "compiled", optimizer, master, mb, accum, seconds, peak,
                                     _tokens(profile, mb, accum, seconds), peak <= budget,
                                     activation_memory_budget=b))
    return out


def best_alternative(alternatives: list[PricedAlternative]) -> Optional[PricedAlternative]:
    """The fitting alternative of most tokens/s (ties: the smaller peak); None when none fits."""
    fitting = [a for a in alternatives if a.fits]
    return min(fitting, key=lambda a: (-a.tokens_per_second, a.peak_bytes)) if fitting else None


__all__ = ["PricedAlternative", "price_alternatives", "best_alternative"]
