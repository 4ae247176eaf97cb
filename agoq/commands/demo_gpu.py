"""What agoq buys on a GPU, which `agoq demo` shows first: `agoq search`'s plans (in this process, agoq.search) from
the profiles of a real model measured on real GPUs that agoq ships (agoq.examples), each against the fastest
alternative that fits the same budget (what a user runs without agoq: bf16, checkpointing, torch.compile, 8-bit AdamW,
as the search prices them from the same profile). These are predictions; what such plans measured when trained is in
docs/results.md ("Plans as a user runs them").

The budgets come from each profile's own measured steps (profile.json's memory.steps, no search needed to find them):
BUDGET_FRACTIONS of the predicted peak of the published agoq-paper recipe (where plain bf16 does not fit), and halfway
from it to plain bf16's peak (where the search may find agoq no longer pays). A budget no plan fits is said with the
smallest one that does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

BUDGET_FRACTIONS = (0.9, 1.0)  # of the agoq-paper recipe's predicted peak
RESULTS = "docs/results.md"


@dataclass
class Row:
    """One budget of one shipped profile: the search's plan against the fastest alternative that fits (tokens/s
    predicted from the profile; None where there is none)."""

    budget: int                      # bytes per GPU
    agoq: bool = True                # the plan uses agoq (False: it is the alternative, no agoq in it)
    plan_tokens: Optional[float] = None   # the plan's tokens/s
    plan_what: str = ""              # how the plan runs, in words
    best_agoq_tokens: Optional[float] = None  # agoq False: the tokens/s of agoq's best plan, not enough faster
    alternative: Optional[str] = None     # the fastest alternative that fits (its name)
    alternative_tokens: Optional[float] = None
    smallest: Optional[int] = None   # no plan fits: the smallest budget one does (None: a plan was found)


def budgets(memory_steps: list[dict]) -> list[int]:
    """The budgets to compare at (module docstring), from profile.json's memory.steps; [] when the profile lacks
    the predicted peaks of agoq-paper and bf16."""
    peaks = {s.get("policy"): s.get("predicted_peak_bytes") for s in memory_steps or []}
    paper, bf16 = peaks.get("agoq-paper"), peaks.get("bf16")
    if not paper or not bf16:
        return []
    return sorted({int(paper * f) for f in BUDGET_FRACTIONS} | {int((paper + bf16) / 2)})


def _what(plan) -> str:
    """How a plan runs, in a few words: compile mode, gradients, optimizer, batch split and what it changes."""
    t = plan.training
    changed = sum(1 for lp in plan.layers if not lp.checkpoint for s in lp.kinds.values() if s != 16)
    parts = [t.compile, "QuanGrad's 8-bit gradients" if plan.gradients.mode == "quangrad8"
             else f"{plan.gradients.mode} gradients", "8-bit AdamW" if plan.optimizer.name == "adamw8bit" else "AdamW",
             f"micro-batch {t.micro_batch} x {t.grad_accum}"]
    if changed:
        parts.append(f"{changed} tensors quantized or recomputed")
    for what, layers in (("checkpointed", plan.checkpoint_layers()), ("offloaded to host memory",
                                                                        plan.offload_layers())):
        if layers:
            parts.append(f"{len(layers)} layer{'s' if len(layers) > 1 else ''} {what}")
    return ", ".join(parts)


def compare(profile, budget: int) -> Row:
    """The search's plan for `profile` (ProfileData) at `budget` against the fastest alternative that fits."""
    from agoq.search.request import InfeasibleBudget
    from agoq.search.search import plan_from_profile

    try:
        plan = plan_from_profile(profile, budget)
    except InfeasibleBudget as e:
        return Row(budget, smallest=e.smallest_budget or 0)
    fitting = [a for a in plan.alternatives or [] if a.fits and a.predicted.tokens_per_second]
    best = max(fitting, key=lambda a: a.predicted.tokens_per_second, default=None)
    row = Row(budget, agoq=plan.decision.agoq, alternative=best.name if best else None,
              alternative_tokens=best.predicted.tokens_per_second if best else None)
    if plan.decision.agoq:
        row.plan_tokens, row.plan_what = plan.decision.tokens_per_second, _what(plan)
    else:  # the plan is the alternative; the agoq plan it replaced is its `alternative`
        row.plan_tokens = best.predicted.tokens_per_second if best else None
        replaced = plan.alternative
        row.best_agoq_tokens = replaced.predicted.tokens_per_second if replaced is not None else None
    return row


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def row_lines(row: Row) -> list[str]:
    """One budget in two lines: agoq's plan, and the fastest alternative that fits (what a user runs without agoq)."""
    at = f"at {_gb(row.budget)}"
    pad = " " * len(at)
    if row.smallest is not None:
        return [f"{at}  no plan fits (the smallest budget one fits is {_gb(row.smallest)})"]
    if not row.agoq:
        from agoq.search.plan_alternatives import FASTER_BY

        agoq = (f"{pad}  agoq's plan   {row.best_agoq_tokens:>7,.0f} tokens/s  less than {FASTER_BY:.0%} faster: the "
                "plan is the one without agoq" if row.best_agoq_tokens else f"{pad}  agoq's plan   none faster")
        return [f"{at}  without agoq  {row.plan_tokens:>7,.0f} tokens/s  {row.alternative}", agoq]
    mine = f"{at}  agoq's plan   {row.plan_tokens:>7,.0f} tokens/s  {row.plan_what}"
    if row.alternative is None:
        return [mine, f"{pad}  without agoq  nothing fits this budget"]
    return [mine, f"{pad}  without agoq  {row.alternative_tokens:>7,.0f} tokens/s  {row.alternative}: agoq's plan "
                  f"{row.plan_tokens / row.alternative_tokens:.2f}x"]


def profile_lines(name: str, folder: Path) -> tuple[list[str], Optional[str]]:
    """The comparison of one shipped profile (its heading and one line per budget), and its headline for the
    demo's closing lines (the budget where agoq's plan gains the most over what fits without it; None: none)."""
    from agoq.formats.profile import load_profile

    profile = load_profile(folder)
    s = profile.settings
    device = (profile.header.get("hardware") or {}).get("name") or s.get("device")
    lines = [f"  {profile.model_name} ({profile.num_layers} layers) on {device}, {s.get('micro_batch')} x "
             f"{s.get('seq_len')} tokens a step (shipped profile {name}):"]
    rows = [compare(profile, b) for b in budgets(profile.memory.get("steps"))]
    lines += ([f"    {line}" for r in rows for line in row_lines(r)]
              or ["    (its profile lacks the agoq-paper and bf16 peaks)"])
    gains = [(r.plan_tokens / r.alternative_tokens if r.alternative_tokens else float("inf"), r)
             for r in rows if r.agoq and r.plan_tokens]
    if not gains:
        return lines, None
    gain, top = max(gains, key=lambda g: g[0])
    said = ("where nothing without agoq fits" if top.alternative is None
            else f"{gain:.2f}x the fastest alternative that fits")
    return lines, f"{profile.model_name} on {device}: at {_gb(top.budget)} agoq's plan is predicted at {said}"


__all__ = ["BUDGET_FRACTIONS", "RESULTS", "Row", "budgets", "compare", "profile_lines", "row_lines"]
