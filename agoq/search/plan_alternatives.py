"""A plan against what a user runs without agoq at its budget: its alternatives priced (agoq.search.alternatives, in
the layouts the search was asked for) and written into the plan, and the plan replaced by its best alternative where
the search cannot show agoq is faster."""

from __future__ import annotations

from typing import Optional

from agoq.formats.plan import Plan
from agoq.formats.profile import ProfileData
from agoq.search.alternatives import best_alternative, price_alternatives
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


def attach_alternatives(plan: Plan, profile: ProfileData, budget: int, found: Optional[KnobSearch] = None) -> None:
    """Price the alternatives (agoq.search.alternatives) at the plan's budget over the same batch splits and compile
    modes, and write `plan.alternatives` and `plan.alternative` (the fastest that fits, with the plan's speed-up)."""
    tried = found.tried if found is not None else []
    splits = sorted({(int(r.knobs.micro_batch or plan.training.micro_batch), int(r.knobs.grad_accum)) for r in tried}
                    or {(plan.training.micro_batch, plan.training.grad_accum)}, reverse=True)
    modes = sorted({plan.training.compile} | ({r.knobs.compile_mode for r in tried if r.knobs.compile_mode}
                                              & set(compile_modes(profile))))
    offload = [(r.knobs.allow_offload, r.knobs.host_budget) for r in tried] or [(True, None)]
    masters = {r.knobs.master for r in tried if r.knobs.master} or {plan.optimizer.master}
    layouts = {resolve_layout(r.knobs.layout, r.knobs.gradient_mode) for r in tried} \
        or {plan_layout(plan) or resolve_layout(None, plan.gradients.mode)}
    priced = price_alternatives(profile, budget, splits, modes, offload=offload[0][0], host_budget=offload[0][1],
                                masters=masters, layouts=tuple(sorted(layouts)))
    seq = plan.training.seq_len
    mine = plan.training.micro_batch * plan.training.grad_accum * seq / plan.predicted.step_seconds \
        if plan.predicted.step_seconds else None
    plan.alternatives = [a.as_plan_field(mine) for a in priced]
    best = best_alternative(priced)
    plan.alternative = None if best is None else best.as_plan_field(mine)


__all__ = ["FASTER_BY", "attach_alternatives", "unless_an_alternative_is_as_fast"]
