"""Pareto fronts: the memory/error front of the MILP over a range of budgets, and the non-dominated filter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from agoq.progress import progress_bar
from agoq.search.costs import ChoiceProblem
from agoq.search.milp import Allocation, Solver


@dataclass
class FrontPoint:
    """One point of a front: the budget it was solved for, its allocation and the knobs it used."""

    budget_bytes: float
    alloc: Allocation
    knobs: dict = field(default_factory=dict)
    source: str = "milp"
    plan: Optional[str] = None
    measured: Optional[dict] = None

    @property
    def peak_bytes(self) -> int:
        return int(max(self.alloc.peak_bytes_per_stage))


def non_dominated(points: Sequence, keys) -> list:
    """The points no other point beats on every key (all minimised); `keys(p)` gives a tuple of floats."""
    values = [tuple(keys(p)) for p in points]
    keep = []
    for i, vi in enumerate(values):
        dominated = any(all(a <= b for a, b in zip(vj, vi)) and any(a < b for a, b in zip(vj, vi))
                        for j, vj in enumerate(values) if j != i)
        if not dominated:
            keep.append(points[i])
    return keep


TimeCap = Union[None, float, Callable[[float], Optional[float]]]
FRONT_SECONDS = 0.25  # a front point's solve stops here with the best choice found (a front shows the trade-off)


def _cap(time_cap: TimeCap, budget: float) -> Optional[float]:
    return time_cap(budget) if callable(time_cap) else time_cap


def budget_range(solver: Solver, objective: str = "error", time_cap: TimeCap = None,
                 error_cap: Optional[float] = None, time_limit: Optional[float] = None) -> tuple[int, int]:
    """(smallest feasible budget, the peak of the best plan with no memory limit), bytes per stage.

    `time_cap` is seconds, None, or a function of the budget (e.g. the best checkpointing's time there).
    `time_limit` bounds each solve (a front's ends: the best found by then)."""
    low = solver.smallest_budget(None if callable(time_cap) else time_cap, error_cap, time_limit)
    if low is None:
        raise ValueError("no choice meets the time cap at any budget")
    free = solver.solve(np.inf, objective, _cap(time_cap, np.inf), error_cap=error_cap, time_limit=time_limit,
                        tie_limit=time_limit)
    return low, max(low, int(max(free.peak_bytes_per_stage)))


def memory_error_front(problem: ChoiceProblem, count: int = 20, objective: str = "error",
                       time_cap: TimeCap = None, solver: Optional[Solver] = None,
                       progress: bool = False, error_cap: Optional[float] = None) -> list[FrontPoint]:
    """Solve at `count` budgets from the smallest feasible one to the unconstrained plan's peak; returns the
    non-dominated points (memory, error, time), smallest memory first."""
    solver = solver or Solver(problem)
    low, high = budget_range(solver, objective, time_cap, error_cap, FRONT_SECONDS)
    # largest first: a solver that keeps its answers skips, at a smaller budget, what did not fit a larger one
    budgets = np.unique(np.linspace(low, high, count).round())[::-1] if count > 1 else np.array([high])
    points = []
    iterator = budgets
    if progress:
        iterator = progress_bar(budgets, desc="pareto budgets", unit="budget")
    for b in iterator:
        try:
            points.append(FrontPoint(float(b), solver.solve(float(b), objective, _cap(time_cap, float(b)),
                                                            error_cap=error_cap, time_limit=FRONT_SECONDS,
                                                            tie_limit=FRONT_SECONDS)))
        except ValueError:  # a budget-dependent cap that nothing meets at this budget
            continue
    unique: dict = {}
    for p in points:  # budgets that give the same choice: keep the smallest budget
        unique.setdefault((p.peak_bytes, round(p.alloc.grad_error, 12), round(p.alloc.step_seconds, 12)), p)
    front = non_dominated(list(unique.values()), lambda p: (p.peak_bytes, p.alloc.grad_error, p.alloc.step_seconds))
    return sorted(front, key=lambda p: (p.peak_bytes, p.alloc.grad_error))
