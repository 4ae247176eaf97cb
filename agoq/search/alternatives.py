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
  torch.compile activation_memory_budget B   compiled, measured: the profile's measured steps under a budget at
                               the split's micro-batch, moved to the split's accumulation, the optimizer and the
                               layout's communication; under FSDP2 the FSDP2 step with every layer kept, moved by
                               what the budget measured against the compiled bf16 step (agoq.search.price)

Over several ranks each is priced in each plain layout the search was asked for: replicated (DDP), fsdp (FSDP2)
and, where the ranks span nodes, hsdp (FSDP2's native HSDP: bf16 gradients, its exact all-reduce across nodes).
Every alternative goes
through the one price of plans (agoq.search.price: the cost model of agoq.search.costs, calibrated on the profile's
measured peaks, with the layout's exposed communication), so a plan and its alternatives are compared on one
footing; this module only enumerates them.
`best_alternative` is the one of most tokens/s among those whose predicted peak fits the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from agoq.formats.profile import ProfileData
from agoq.search.costs import ProblemSettings, build_problem, checkpointing_only
from agoq.search.layouts import resolve_layout
from agoq.search.milp import InfeasibleBudget, Solver
from agoq.search.price import Configuration, price
from agoq.search.timing import prices
from agoq.vocabulary import OPTIMIZERS as _OPTIMIZERS

OPTIMIZERS = tuple((name, "fp32") for name in _OPTIMIZERS)  # (optimizer, masters) a user runs without agoq
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
    layout: str = "replicated"                         # replicated (one process or DDP), fsdp (FSDP2) or hsdp
    communication_seconds: float = 0.0                 # of the step, the layout's exposed collectives

    def as_plan_field(self, plan_tokens_per_second: Optional[float] = None) -> dict:
        """The plan's `alternative` / `alternatives` entry (agoq.formats.plan.Alternative)."""
        out = {"name": self.name, "compile": self.compile, "layout": self.layout,
               "optimizer": {"name": self.optimizer, "master": self.master}, "gradients": "bf16",
               "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
               "checkpoint_layers": list(self.checkpoint_layers), "offload_layers": list(self.offload_layers),
               "activation_memory_budget": self.activation_memory_budget,
               "predicted": {"step_seconds": self.step_seconds, "peak_bytes": self.peak_bytes,
                             "tokens_per_second": self.tokens_per_second,
                             "communication_seconds": self.communication_seconds,
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


# the layouts a user runs without agoq, over several ranks (HSDP: FSDP2's own, bf16 with its exact all-reduce across
# nodes, where the ranks span nodes)
LAYOUT_NAMES = {"replicated": "DDP", "fsdp": "FSDP2", "hsdp": "HSDP"}
PLAIN_LAYOUTS = tuple(LAYOUT_NAMES)


def price_alternatives(profile: ProfileData, budget: float, splits: list[tuple[int, int]],
                       compile_modes: list[str], *, offload: bool = True,
                       host_budget: Optional[float] = None, masters=("fp32",),
                       layouts=("replicated",)) -> list[PricedAlternative]:
    """Every alternative of the module docstring at `budget` bytes (largest stage), for each (micro_batch,
    grad_accum) of `splits`, each compile mode and each of `layouts` (replicated: one process or DDP; fsdp: FSDP2;
    hsdp: FSDP2 over replicas across nodes),
    each priced by the one price
    (agoq.search.price) with bf16 gradients (`offload` False: none offloads; `host_budget`: bytes offload may pin,
    None the profile's pinnable bytes; `masters`: those the search may choose, "none" adding the 8-bit AdamW without
    masters)."""
    optimizers = OPTIMIZERS + ((WITHOUT_MASTERS,) if "none" in masters else ())
    world = profile.world_size
    out: list[PricedAlternative] = []
    for layout in [layout for layout in PLAIN_LAYOUTS if layout in layouts]:
        for compile_mode in compile_modes:
            for mb, accum in splits:
                for optimizer, master in optimizers:
                    knobs = ProblemSettings(gradient_mode="bf16", optimizer=optimizer, master=master,
                                            compile_mode=compile_mode, micro_batch=mb, grad_accum=accum,
                                            allow_offload=offload, host_budget=host_budget, layout=layout)
                    try:
                        problem = build_problem(profile, knobs)
                    except ValueError:
                        continue
                    out += _per_layer_alternatives(profile, problem, knobs, budget, world)
                    if compile_mode == "compiled":  # DDP or FSDP2 (agoq train compiles the layers it shards)
                        out += _memory_budget_points(profile, problem, knobs, budget, world)
    return out


def _alternative(profile: ProfileData, problem, config: Configuration, what: str, budget: float,
                 world: int) -> PricedAlternative:
    """`config` priced (agoq.search.price) as the alternative named `what`."""
    k = config.knobs
    p = price(profile, config, problem)
    layout = resolve_layout(k.layout, "bf16")
    name = (f"{LAYOUT_NAMES[layout]} " if world > 1 else "") + _label(k.compile_mode, what, k.optimizer,
                                                                       k.micro_batch, k.grad_accum, k.master)
    return PricedAlternative(name, k.compile_mode, k.optimizer, k.master, k.micro_batch, k.grad_accum,
                             p.step_seconds, p.peak_bytes, p.tokens_per_second(profile, k), p.peak_bytes <= budget,
                             list(config.checkpoint_layers), config.activation_memory_budget,
                             list(config.offload_layers), p.activation_bytes_per_stage, p.memory_per_stage,
                             p.host_bytes, p.offload_link_seconds, layout=layout,
                             communication_seconds=p.communication_seconds)


def _per_layer_alternatives(profile: ProfileData, problem, knobs: ProblemSettings, budget: float,
                            world: int) -> list[PricedAlternative]:
    """bf16, the fastest fitting checkpointing, and each with its least fitting offloaded prefix where it does not
    fit (module docstring), at `knobs`."""
    L = problem.num_layers
    bf16 = _alternative(profile, problem, Configuration(knobs), "bf16", budget, world)
    out = [bf16]
    if problem.offload is not None and not bf16.fits:
        out += _offload_alternative(profile, problem, Configuration(knobs), "bf16", budget, world)
    if not problem.allow_checkpoint:
        return out
    try:
        ckpt = Solver(checkpointing_only(problem)).solve(budget, "time").checkpoint
    except InfeasibleBudget:
        ckpt = np.ones(L, dtype=bool)
    n = int(ckpt.sum())
    if n:  # none checkpointed is the bf16 entry
        what = "full checkpointing" if n == L else f"selective checkpointing ({n}/{L} layers)"
        config = Configuration(knobs, checkpoint_layers=tuple(int(i) for i in np.nonzero(ckpt)[0]))
        checkpointed = _alternative(profile, problem, config, what, budget, world)
        out.append(checkpointed)
        if n == L and not checkpointed.fits and problem.offload is not None:
            out += _offload_alternative(profile, problem, config, "full checkpointing", budget, world,
                                        offloaded="inputs offloaded")
    return out


def _offload_alternative(profile: ProfileData, problem, config: Configuration, what: str, budget: float, world: int,
                         *, offloaded: str = "offload") -> list:
    """`config` with the first K layers' saved tensors in host memory, the least K that fits `budget` within the
    host budget ([] when none does).

    Offloading one more layer moves that layer's saved bytes to the host: the GPU peak does not rise and the host
    bytes do not fall as K grows (every K of 110 such calls, two committed profiles at four budgets each; on 143
    calls over three profiles at six budgets the bisection gave the scan's alternatives; the least K is checked
    against every K in tests/search/test_alternatives.py). So K is found by bisection over 1..L, about
    log2(L) + 1 prices where a scan took up to L (most calls, at a budget none fits, priced all 16 of the probe's:
    half of a plan request's time)."""
    L = problem.num_layers
    priced: dict[int, PricedAlternative] = {}

    def at(k: int) -> PricedAlternative:
        if k not in priced:
            priced[k] = _alternative(profile, problem, replace(config, offload_layers=tuple(range(k))),
                                     f"{what} + {offloaded} {k}/{L} layers", budget, world)
        return priced[k]

    if L < 1 or not at(L).fits:
        return []
    lo, hi = 1, L  # the least K that fits is in lo..hi; at(hi) fits
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid).fits:
            hi = mid
        else:
            lo = mid + 1
    return [at(lo)] if at(lo).host_bytes <= problem.offload.host_budget_bytes else []


def _memory_budget_points(profile: ProfileData, problem, knobs: ProblemSettings, budget: float,
                          world: int) -> list:
    """compile's activation_memory_budget at each budget the profile measured at this micro-batch, priced at
    `knobs` (agoq.search.price: its split, optimizer and the layout's communication)."""
    mb = knobs.micro_batch or prices(profile).m0
    out = []
    for b in sorted({float(r["activation_memory_budget"]) for r in prices(profile).memory_budget_rows()
                     if r.get("peak_bytes") is not None and int(r["micro_batch"]) == mb}, reverse=True):
        try:
            out.append(_alternative(profile, problem, Configuration(knobs, activation_memory_budget=b),
                                    f"activation_memory_budget {b:g}", budget, world))
        except ValueError:
            continue
    return out


def best_alternative(alternatives: list[PricedAlternative]) -> Optional[PricedAlternative]:
    """The fitting alternative of most tokens/s (ties: the smaller peak); None when none fits."""
    fitting = [a for a in alternatives if a.fits]
    return min(fitting, key=lambda a: (-a.tokens_per_second, a.peak_bytes)) if fitting else None


__all__ = ["PricedAlternative", "price_alternatives", "best_alternative"]
