"""A plan against what a user runs without agoq at its budget: its alternatives priced (agoq.search.alternatives, in
the layouts the search was asked for) and written into the plan, and the plan replaced by its best alternative where
the search cannot show agoq is faster."""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple, Optional, Sequence

from agoq.formats.plan import Plan
from agoq.formats.profile import ProfileData
from agoq.search.alternatives import PricedAlternative, best_alternative, price_alternatives
from agoq.search.costs import ProblemSettings
from agoq.search.highs import side_pool
from agoq.search.knobs import KnobSearch
from agoq.search.layouts import resolve_layout
from agoq.search.plan_builder import plan_of_alternative
from agoq.search.price import plan_layout
from agoq.search.timing import compile_modes

# how much faster than its best alternative a plan must be predicted to be taken over it: the run-to-run spread of
# measured steps (about 1 %) and the cost model's error on them (experiments/results/plan_accuracy_*.json)
FASTER_BY = 0.02


def unless_an_alternative_is_as_fast(plan: Plan, profile: ProfileData) -> Plan:
    """`plan`, or its best alternative as a plan with no agoq in it (plan_builder.plan_of_alternative) where the
    search cannot show that `plan` is faster: predicted less than FASTER_BY faster than the alternative."""
    alt = plan.alternative
    plain = plan.gradients.mode == "bf16" and not plan.checkpoint_layers() and all(
        s == 16 for lp in plan.layers for s in lp.kinds.values())
    if plain:  # it keeps every tensor and stores bf16 gradients: no agoq in it already
        plan.decision.agoq = False
        plan.decision.reason += "; it keeps every tensor as it is (no agoq needed at this budget)"
        return plan
    if alt is None or not alt.speedup_predicted or alt.speedup_predicted >= 1.0 + FASTER_BY:
        return plan
    return plan_of_alternative(plan, f"no agoq: {alt.name} (what a user runs without agoq) is predicted at "
                                     f"{alt.predicted.tokens_per_second:,.0f} tokens/s, the best plan with agoq at "
                                     f"{plan.decision.tokens_per_second:,.0f} ({alt.speedup_predicted:.3f}x), less "
                                     f"than {FASTER_BY:.0%} faster: the plan is that alternative", profile)


def alternatives_pricing(profile: ProfileData, budget: int, knobs: Sequence[ProblemSettings]) -> Optional[Future]:
    """The alternatives of a search about to try the combinations `knobs`, priced on agoq.search.highs.side_pool
    while it searches them: they depend on the combinations and the budget only, not on the plan (the caller holds
    agoq.search.highs.quiet_stdout until they are in, and passes them to attach_alternatives). None where some
    combination leaves its micro-batch, compile mode or master to the plan (knobs.combinations sets them all):
    attach_alternatives prices them after the plan, as it does without a head start."""
    if not knobs or any(k.micro_batch is None or k.compile_mode is None or not k.master for k in knobs):
        return None
    return side_pool().submit(_priced, profile, budget, _pricing(profile, knobs, None))


class Priced(NamedTuple):
    """Alternatives priced at one budget, and what they were priced over (price_alternatives' keywords)."""

    asked: dict
    alternatives: list[PricedAlternative]


def attach_alternatives(plan: Plan, profile: ProfileData, budget: int, found: Optional[KnobSearch] = None,
                        priced: Optional[Priced] = None) -> Priced:
    """Price the alternatives (agoq.search.alternatives) at the plan's budget over the same batch splits and compile
    modes, and write `plan.alternatives` and `plan.alternative` (the fastest that fits, with the plan's speed-up).
    `priced`: alternatives already priced at `budget` (alternatives_pricing's, or this function's return for another
    plan of the same search), used where this plan asks for the same splits, compile modes, masters and layouts (a
    plan of the Optuna study may add its own compile mode: priced again). Returns the alternatives written."""
    knobs = [r.knobs for r in found.tried] if found is not None else []
    asked = _pricing(profile, knobs, plan)
    if priced is None or priced.asked != asked:
        priced = _priced(profile, budget, asked)
    seq = plan.training.seq_len
    mine = plan.training.micro_batch * plan.training.grad_accum * seq / plan.predicted.step_seconds \
        if plan.predicted.step_seconds else None
    plan.alternatives = [a.as_plan_field(mine) for a in priced.alternatives]
    best = best_alternative(priced.alternatives)
    plan.alternative = None if best is None else best.as_plan_field(mine)
    return priced


def _priced(profile: ProfileData, budget: int, asked: dict) -> Priced:
    return Priced(asked, price_alternatives(profile, budget, **asked))


def _pricing(profile: ProfileData, knobs: Sequence[ProblemSettings], plan: Optional[Plan]) -> dict:
    """price_alternatives' splits, compile modes, offload, masters and layouts: those of the combinations `knobs`
    (the first one's offload), with the plan's own where they leave one unset or there are none. `plan` None:
    every combination sets them (alternatives_pricing)."""
    splits = sorted({(int(k.micro_batch or plan.training.micro_batch), int(k.grad_accum)) for k in knobs}
                    or {(plan.training.micro_batch, plan.training.grad_accum)}, reverse=True)
    own = {plan.training.compile} if plan is not None else set()
    modes = sorted(own | ({k.compile_mode for k in knobs if k.compile_mode} & set(compile_modes(profile))))
    offload = [(k.allow_offload, k.host_budget) for k in knobs] or [(True, None)]
    masters = {k.master for k in knobs if k.master} or {plan.optimizer.master}
    layouts = {resolve_layout(k.layout, k.gradient_mode) for k in knobs} \
        or {plan_layout(plan) or resolve_layout(None, plan.gradients.mode)}
    return {"splits": splits, "compile_modes": modes, "offload": offload[0][0], "host_budget": offload[0][1],
            "masters": masters, "layouts": tuple(sorted(layouts))}


__all__ = ["FASTER_BY", "Priced", "alternatives_pricing", "attach_alternatives", "unless_an_alternative_is_as_fast"]
