"""One price for every configuration a step can run: agoq's plans and the alternatives a user would run without
agoq go through `price`, so that a plan and what it is compared with are priced on one footing.

A `Configuration` is everything one training step runs: the knobs outside the per-layer choice
(agoq.search.problem.ProblemSettings: layout, gradients, optimizer and masters, micro-batch x accumulation, compile
mode, offload permissions), each layer's kinds, the checkpointed and offloaded layers, and torch.compile's
`activation_memory_budget`. `price` returns its `Price`: the step (and, of it, the layout's exposed communication
and the host link's seconds) and the peak per rank and stage, with the peak's parts by phase.

  per-layer configurations  the cost model of agoq.search.costs: ChoiceProblem.evaluate of the choice, where

      step = measured bf16 step at the knobs + the layers' and checkpoints' seconds + offload's + communication

  compile's activation_memory_budget B  the partitioner decides what each layer keeps, so there is no per-layer
      choice to model: the step and peak are the profile's measured compiled step under B (agoq.search.timing), at
      the configuration's micro-batch, moved to its knobs by what the profile measured the knobs to add:

      step = T_B(m, a0) + [T_bf16(m, a) - T_bf16(m, a0)]                  another accumulation a (a0 measured)
                        + [T_bf16(optimizer) - T_bf16(row's optimizer)]     another optimizer or masters
                        + communication                                    the same layout's collectives as any
                                                                           configuration of these knobs
      peak = P_B + d(state bytes) + d(optimizer step transient)           another optimizer or masters
                 + gradients  (a > 1 measured at a0 = 1: the first micro-batch's bf16 gradients are kept through
                               the others, as agoq.search.costs counts for every accumulating bf16 step)
                 + the compiled peak margin (agoq.search.calibration)
                 + the layout's peak margin over several ranks (agoq.search.layout_calibration)
      and the communication is the layout's calibrated on the profile's multi-rank layout step, as for any
      configuration of the layout (agoq.search.layout_calibration)

      Under FSDP2 (agoq train applies the budget to the compiled layers it then shards) the price is FSDP2's of the
      same knobs with every layer kept, moved by what the budget measured against the compiled bf16 step of its
      split: its recompute seconds per micro-batch and the activation bytes it saves (`_fsdp_budget_price`).
      Replicated (one process, or DDP), fsdp and hsdp run compile's budget here, with bf16 gradients: other
      configurations are refused with ValueError.

A configuration the profile cannot price raises ValueError saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from agoq.runtime.activations.policy import KINDS
from agoq.formats.profile import ProfileData
from agoq.search.calibration import margin
from agoq.search.costs import build_problem, state_parts, static_bytes_total
from agoq.search.layouts import resolve_layout
from agoq.search.problem import ChoiceProblem, ProblemSettings
from agoq.search.state import resolve_optimizer
from agoq.search.timing import prices
from agoq.vocabulary import FSDP2_LAYOUTS


@dataclass(frozen=True)
class Configuration:
    """What one training step runs (see the module docstring). `kinds`: (layer, kind, option) of every kind not at
    16 ("16", "8", ..., "recompute" as agoq.search.problem names options); layers listed in `checkpoint_layers` keep
    all their kinds at 16."""

    knobs: ProblemSettings
    kinds: tuple = ()
    checkpoint_layers: tuple = ()
    offload_layers: tuple = ()
    activation_memory_budget: Optional[float] = None

    @classmethod
    def of_plan(cls, plan) -> "Configuration":
        """The configuration an agoq plan (agoq.formats.plan.Plan) runs."""
        kinds = tuple((lp.layer, kind, str(setting)) for lp in plan.layers for kind, setting in lp.kinds.items()
                      if str(setting) != "16")
        t = plan.training
        knobs = ProblemSettings(block=plan.activations.block, format=plan.activations.format,
                                micro_batch=t.micro_batch, grad_accum=t.grad_accum, gradient_mode=plan.gradients.mode,
                                schedule=plan.pipeline.schedule,
                                layer_stage=tuple(lp.stage for lp in plan.layers),
                                optimizer=plan.optimizer.name, master=plan.optimizer.master, compile_mode=t.compile,
                                layout=plan_layout(plan), allow_offload=bool(plan.offload_layers()),
                                host_budget=getattr(plan, "host_budget_bytes", None),
                                weight_gather=(plan.parallel.weight_gather if plan.parallel is not None else None)
                                or "bf16")
        return cls(knobs, kinds, tuple(plan.checkpoint_layers()), tuple(plan.offload_layers()),
                   t.activation_memory_budget)


def plan_layout(plan) -> Optional[str]:
    """The search's layout word (agoq.search.layouts) of a plan's dims (`Plan.dims()`): replicated, fsdp or hsdp
    (None: the plan has none, or is a pipeline: the gradient mode's own)."""
    dims = plan.dims()
    return None if dims is None or dims.pipeline > 1 else dims.layout


@dataclass
class Price:
    """A configuration's predicted figures: seconds per step (of them, the layout's exposed communication and, with
    offloaded layers, the host link's seconds), bytes per rank and stage (the peak, the decoder layers'
    activations at the end of forward, and the peak's parts by phase, agoq.search.memory_parts; None where the figures
    are measured rather than modelled, as for compile's budget), bytes offloaded to the host per micro-batch, and the
    predicted gradient error."""

    step_seconds: float
    communication_seconds: float
    peak_bytes_per_stage: list
    activation_bytes_per_stage: Optional[list] = None
    memory_per_stage: Optional[list] = None
    host_bytes: Optional[int] = None
    offload_link_seconds: Optional[float] = None
    grad_error: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """The largest stage's peak."""
        return int(max(self.peak_bytes_per_stage))

    def tokens_per_second(self, profile: ProfileData, knobs: ProblemSettings) -> float:
        """Tokens one rank trains per second: micro-batch x accumulation x sequence length / step."""
        mb = knobs.micro_batch or int(profile.settings.get("micro_batch", 1) or 1)
        seq = int(profile.settings.get("seq_len", 1) or 1)
        return mb * int(knobs.grad_accum) * seq / self.step_seconds if self.step_seconds > 0 else 0.0


def price(profile: ProfileData, config: Configuration, problem: Optional[ChoiceProblem] = None) -> Price:
    """`config`'s Price (module docstring). `problem`: build_problem(profile, config.knobs), where the caller has it
    already. Raises ValueError for a configuration the profile cannot price."""
    problem = problem if problem is not None else build_problem(profile, config.knobs)
    if config.activation_memory_budget is not None:
        return _budget_price(profile, config, problem)
    chosen, checkpoint, offload = choice(problem, config)
    figures = problem.evaluate(chosen, checkpoint, offload)
    try:
        parts = problem.memory_parts(chosen, checkpoint, offload)
    except ValueError:
        parts = None
    offloaded = offload is not None
    return Price(float(figures["step_seconds"]), float(problem.communication_seconds),
                 [int(p) for p in figures["peak_bytes_per_stage"]], list(figures["activation_bytes_per_stage"]),
                 parts, int(figures["host_bytes"]) if offloaded else None,
                 float(figures["offload_link_seconds"]) * problem.offload.grad_accum if offloaded else None,
                 float(figures["grad_error"]))


def choice(problem: ChoiceProblem, config: Configuration) -> tuple:
    """(option indices, checkpointed mask, offloaded mask or None) of `config` in `problem`; ValueError where the
    problem does not offer one of its options."""
    L = problem.num_layers
    checkpoint = np.zeros(L, dtype=bool)
    for l in config.checkpoint_layers:
        if not 0 <= int(l) < L:
            raise ValueError(f"checkpointed layer {l} is not a layer of this {L}-layer model")
        checkpoint[int(l)] = True
    if checkpoint.any() and not problem.allow_checkpoint:
        raise ValueError("these knobs offer no whole-layer checkpointing (the profile measured no checkpoint-all "
                         "step at them)")
    wanted = {(int(l), str(k)): str(o) for l, k, o in config.kinds}
    chosen = []
    for (layer, kind), options in sorted(problem.groups().items()):
        if checkpoint[layer]:
            continue
        option = wanted.pop((layer, KINDS[kind]), "16")
        match = [i for i in options if problem.option[i] == option]
        if not match:
            raise ValueError(f"layer {layer} {KINDS[kind]}: option {option} is not offered at these knobs (not "
                             "measured, below a floor, or attention kept at 16)")
        chosen.append(match[0])
    left = {key: o for key, o in wanted.items() if not checkpoint[key[0]] and o != "16"}
    if left:
        raise ValueError(f"options of kinds the profile has no rows for: {sorted(left.items())}")
    offload = None
    if config.offload_layers:
        offload = np.zeros(L, dtype=bool)
        offload[[int(l) for l in config.offload_layers]] = True
    return np.array(chosen, dtype=int), checkpoint, offload


def _budget_price(profile: ProfileData, config: Configuration, problem: ChoiceProblem) -> Price:
    """compile's activation_memory_budget (module docstring)."""
    knobs, b = config.knobs, float(config.activation_memory_budget)
    layout = resolve_layout(knobs.layout, knobs.gradient_mode)
    if knobs.compile_mode != "compiled" or knobs.gradient_mode != "bf16":
        raise ValueError("compile's activation_memory_budget is priced compiled, with bf16 gradients (not "
                         f"{knobs.compile_mode}, {knobs.gradient_mode}, {layout})")
    if config.kinds or config.checkpoint_layers or config.offload_layers:
        raise ValueError("compile's activation_memory_budget decides what the layers keep: no per-layer choice "
                         "goes with it")
    sp = prices(profile)
    mb = knobs.micro_batch or sp.m0
    accum = int(knobs.grad_accum)
    rows = [r for r in sp.memory_budget_rows() if r.get("peak_bytes") is not None
            and float(r["activation_memory_budget"]) == b and int(r["micro_batch"]) == mb]
    if not rows:
        raise ValueError(f"the profile measured no compiled step under activation_memory_budget {b:g} at "
                         f"micro-batch {mb}")
    row = min(rows, key=lambda r: (int(r["grad_accum"]) != accum, int(r["grad_accum"])))
    a0 = int(row["grad_accum"])
    if layout in FSDP2_LAYOUTS:
        return _fsdp_budget_price(profile, config, problem, row)
    seconds = sp.price(row)
    optimizer = problem_optimizer(profile, knobs)
    if a0 != accum:  # what further micro-batches cost: the bf16 steps' line at this micro-batch
        theirs = sp.seconds("compiled", mb, accum, "bf16", row["optimizer"], row["master"])
        ours = sp.seconds("compiled", mb, a0, "bf16", row["optimizer"], row["master"])
        if theirs is None or ours is None:
            raise ValueError(f"the profile measured no compiled bf16 steps at micro-batch {mb} to move compile's "
                             f"budget step from {a0} to {accum} micro-batches")
        seconds += theirs - ours
    if optimizer != (row["optimizer"], row["master"]):
        theirs = sp.seconds("compiled", sp.m0, 1, "bf16", *optimizer)
        ours = sp.seconds("compiled", sp.m0, 1, "bf16", row["optimizer"], row["master"])
        if theirs is None or ours is None:
            raise ValueError(f"the profile measured no compiled bf16 step with {optimizer[0]} and masters "
                             f"{optimizer[1]} to move compile's budget step to")
        seconds += theirs - ours
    static = static_bytes_total(profile, "bf16", *optimizer) \
        - static_bytes_total(profile, "bf16", row["optimizer"], row["master"])
    transient = state_parts(profile, "bf16", *optimizer)["step_transient"] \
        - state_parts(profile, "bf16", row["optimizer"], row["master"])["step_transient"]
    kept = state_parts(profile, "bf16", *optimizer)["gradients"] if accum > 1 and a0 == 1 else 0.0
    peak = int(float(row["peak_bytes"]) + static + max(0.0, transient) + kept + margin(profile, "compiled")[0]
               + layout_margin(problem))
    comm = float(problem.communication_seconds)
    return Price(_positive(seconds, b) + comm, comm, [peak] * problem.num_stages)


def _fsdp_budget_price(profile: ProfileData, config: Configuration, problem: ChoiceProblem, row: dict) -> Price:
    """compile's activation_memory_budget B under FSDP2 (module docstring): the FSDP2 price of the same knobs with
    every layer kept, moved by what B measured against the compiled bf16 step of its split (one rank):

      step = step_fsdp(knobs) + accum x [T_B(m, a0) - T_bf16(m, a0)] / a0      B's recompute, per micro-batch
      peak = max(peak_fsdp(knobs) + max(P_B - P_bf16(m, a0), -activations), the optimizer step's floor)
                                                                              the activations B saves (at most all)
    """
    sp = prices(profile)
    mb, a0, accum = int(row["micro_batch"]), int(row["grad_accum"]), int(config.knobs.grad_accum)
    plain = sp.row("compiled", "bf16", mb, a0, "bf16", row["optimizer"], row["master"])
    if plain is None or plain.get("peak_bytes") is None:
        raise ValueError(f"the profile measured no compiled bf16 step at micro-batch {mb} x {a0} to move compile's "
                         "budget step to FSDP2 from")
    kept = price(profile, replace(config, activation_memory_budget=None), problem)
    seconds = kept.step_seconds + accum * (sp.price(row) - sp.price(plain)) / a0
    saved = float(row["peak_bytes"]) - float(plain["peak_bytes"])
    floor = problem.peak_floor()
    peaks = [int(max(p + max(saved, -float(a)), float(floor[s])))
             for s, (p, a) in enumerate(zip(kept.peak_bytes_per_stage, kept.activation_bytes_per_stage))]
    return Price(_positive(seconds, float(config.activation_memory_budget)), kept.communication_seconds, peaks)


def _positive(seconds: float, budget: float) -> float:
    """A compile's-budget step moved by differences of measured steps, refused where it comes out at or below
    zero: the profile's steps disagree by more than the step itself (noise, e.g. a small model on a busy CPU)."""
    if not seconds > 0:
        raise ValueError(f"compile's activation_memory_budget {budget:g} prices at {seconds * 1e3:.3g} ms from the "
                         "profile's measured steps (their differences exceed the step: measurement noise); it is "
                         "left out")
    return seconds


def layout_margin(problem: ChoiceProblem) -> float:
    """Bytes per rank the layout's calibration on the profile's multi-rank layout step adds to every peak of the
    layout (agoq.search.layout_calibration; 0 where it has none)."""
    parts = problem.static_parts or {}
    return float(parts["layout_margin"][0]) if "layout_margin" in parts else 0.0


def problem_optimizer(profile: ProfileData, knobs: ProblemSettings) -> tuple[str, str]:
    """(optimizer, masters) the knobs run (the profile's step's where they leave them unset)."""
    return tuple(resolve_optimizer(profile, knobs.optimizer, knobs.master))


def with_knobs(config: Configuration, **changes) -> Configuration:
    """`config` with some of its knobs changed."""
    return replace(config, knobs=replace(config.knobs, **changes))


__all__ = ["Configuration", "Price", "price", "choice", "plan_layout", "with_knobs"]
