"""The solver `agoq search` asks: the best per-layer choice under a memory budget per stage, with optional caps on
step time and gradient error, for one problem at many budgets (the MILP of agoq.search.milp_model, built once).

Each question becomes the mixed-integer programs that answer it: a cap the optimum of its own objective meets
or misses is checked on that optimum; without a time cap, pipeline stages do not interact and are solved one by
one; an infeasible budget is answered with the smallest one that fits. The first objective's solve stops after
PRIMARY_SECONDS (its best choice found by then is kept, with `Allocation.gap` the relative gap left).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from agoq.search.problem import ChoiceProblem, checkpointing_only, recipe_error
from agoq.search.milp_least import least_peak, least_peak_bound
from agoq.search.milp_model import Allocation, Model, primary_gap
from agoq.search.request import CHECKPOINT_CAP, RECIPE_CAP, InfeasibleBudget
from agoq.units import format_bytes_apart

PRIMARY_SECONDS = 10.0  # default time limit of the first objective's solve (its best choice found is kept)


class Solver:
    """Solves one ChoiceProblem for many budgets (the matrices are built once)."""

    def __init__(self, problem: ChoiceProblem, *, tie_break: bool = True):
        """`tie_break` False: solve the first objective only (exact), leaving its ties unbroken by the second —
        much faster, for comparing problems by their optimum before solving the winner in full."""
        self.problem = problem
        self._model = Model(problem)
        self._stages: Optional[list] = None  # per-stage sub-solvers, built when first needed
        self.tie_break = tie_break

    @property
    def tie_break(self) -> bool:
        return self._model.tie_break

    @tie_break.setter
    def tie_break(self, value: bool) -> None:
        """Switch tie-breaking on or off; a first objective already solved is reused, not solved again."""
        self._model.tie_break = bool(value)
        for model, _, _ in self._stages or []:
            model.tie_break = bool(value)

    def _stage_solvers(self) -> list:
        """Without a time cap the stages do not interact: each is solved on its own (exactly the same
        optimum, a much smaller branch and bound)."""
        if self._stages is None:
            p = self.problem
            self._stages = []
            for s in range(p.num_stages):
                layers = np.nonzero(p.layer_stage == s)[0]
                renumber = -np.ones(p.num_layers, dtype=int)
                renumber[layers] = np.arange(len(layers))
                idx = np.nonzero(np.isin(p.layer, layers))[0]
                sub = ChoiceProblem(renumber[p.layer[idx]], p.kind[idx], [p.option[i] for i in idx], p.memory[idx],
                                    p.seconds[idx], p.error[idx], np.zeros(len(layers), dtype=int),
                                    p.checkpoint_memory[layers], p.checkpoint_seconds[layers], p.allow_checkpoint,
                                    p.unmodified_extra[layers], p.shared_credit[layers],
                                    p.static_bytes[s:s + 1], 0.0, p.seconds_scale,
                                    floor_bytes=p.peak_floor()[s:s + 1], in_flight=p.in_flight_counts()[s:s + 1],
                                    recompute_bytes=p.recomputed()[layers],
                                    laaq_transient_bytes=p.laaq_transient()[s:s + 1],
                                    laaq_layer_seconds=p.laaq_layer_seconds,
                                    unmodified_calibration=None if p.unmodified_calibration is None
                                    else p.unmodified_calibration[layers],
                                    checkpoint_calibration=None if p.checkpoint_calibration is None
                                    else p.checkpoint_calibration[layers],
                                    one_setting_per_stage=p.one_setting_per_stage, **p.pairs_within(idx))
                model = Model(sub)
                model.tie_break = self.tie_break
                self._stages.append((model, idx, layers))
        return self._stages

    def _budgets(self, budget) -> np.ndarray:
        """Per-stage budgets in whole bytes, rounded down: a choice's peak is reported in whole bytes rounded up
        (ChoiceProblem.evaluate), so it fits a budget B exactly when its exact bytes fit floor(B). The MILP's rows
        compare exact bytes; at B itself they would pick a choice of 738.07 bytes for a budget of 738.27, which
        then reports 739 and is over."""
        b = np.asarray(budget, dtype=float)
        return np.floor(np.full(self.problem.num_stages, float(b)) if b.ndim == 0 else b)

    def least_memory(self, time_cap: Optional[float] = None, error_cap: Optional[float] = None,
                     time_limit: Optional[float] = None, below: Optional[float] = None,
                     patient: bool = True) -> Optional[Allocation]:
        """The choice of least peak (the largest stage's), within the caps; None when the caps cannot be met, or,
        with `below` (bytes), when no choice peaks under it. `time_limit` (default PRIMARY_SECONDS) bounds the solve:
        then the least peak found by then; none found by then, it searches on, unless not `patient` (then None)
        (agoq.search.milp_least)."""
        return least_peak(self._model, time_cap, error_cap, PRIMARY_SECONDS if time_limit is None else time_limit,
                          below, patient)

    def least_memory_bound(self, time_cap: Optional[float] = None, error_cap: Optional[float] = None,
                           by_prefix: bool = False) -> Optional[float]:
        """A lower bound on least_memory's peak, bytes, from one LP (`by_prefix`: one per offloaded prefix, tighter);
        None when no choice meets the caps (agoq.search.milp_least.least_peak_bound)."""
        return least_peak_bound(self._model, time_cap, error_cap, by_prefix)

    def smallest_budget(self, time_cap: Optional[float] = None, error_cap: Optional[float] = None,
                        time_limit: Optional[float] = None) -> Optional[int]:
        """The least per-stage budget (bytes, same for every stage) that some choice fits; None when the
        caps alone cannot be met (`time_limit` as least_memory's)."""
        alloc = self.least_memory(time_cap, error_cap, time_limit)
        return None if alloc is None else int(max(alloc.peak_bytes_per_stage))  # floor included

    def relaxed_bound(self, budget, objective: str = "error", time_cap: Optional[float] = None,
                      error_cap: Optional[float] = None) -> Optional[float]:
        """A lower bound on what `solve` would return for the first objective (step seconds for "time", gradient
        error for "error"): the optimum of the linear relaxation (every 0/1 variable in [0, 1]), milliseconds of
        work where the MILP may take seconds. None when even the relaxation has no solution (then no choice fits);
        -inf when HiGHS gives no answer (no bound)."""
        return self._model.relaxed_bound(self._budgets(budget), objective, time_cap, error_cap)

    def improves(self, budget, objective: str, value: float, *, time_cap: Optional[float] = None,
                 error_cap: Optional[float] = None, time_limit: float = PRIMARY_SECONDS) -> bool:
        """Whether some choice under `budget` and the caps beats `value` on the first objective (step seconds for
        "time", gradient error for "error"), as far as `time_limit` seconds of search find: a question cheaper
        than `solve` (no optimum, no ties, no search past the limit; a relaxation that cannot beat `value` answers
        it without a solve). False where nothing better was found."""
        return self._model.improves(self._budgets(budget), objective, value, time_cap, error_cap, time_limit)

    def solve(self, budget, objective: str = "error", time_cap: Optional[float] = None,
              time_limit: Optional[float] = None, error_cap: Optional[float] = None,
              tie_limit: Optional[float] = None) -> Allocation:
        """The best choice under `budget` bytes per stage (a number, or one per stage), with optional caps on
        step seconds and gradient error. `time_limit` bounds the first objective's solve (PRIMARY_SECONDS by
        default); its ties are broken exactly, unless `tie_limit` bounds that solve too (e.g. a front's points).

        Raises InfeasibleBudget, whose message gives the smallest feasible budget.
        """
        budgets = self._budgets(budget)
        time_limit = PRIMARY_SECONDS if time_limit is None else time_limit
        alloc = self._solve(budgets, objective, time_cap, time_limit, error_cap, tie_limit)
        over = np.asarray(alloc.peak_bytes_per_stage, float) - budgets
        if (over > 0).any():  # within the solver's feasibility tolerance, a few bytes over: ask for less
            try:
                alloc = self._solve(budgets - np.maximum(over, 0) - 1, objective, time_cap, time_limit, error_cap,
                                    tie_limit)
            except InfeasibleBudget:
                alloc = None
            if alloc is None or (np.asarray(alloc.peak_bytes_per_stage) > budgets).any():
                # the budget is within a few bytes of the least memory: that choice is the one that fits
                alloc = self.least_memory(time_cap, error_cap)
                if alloc is None or (np.asarray(alloc.peak_bytes_per_stage) > budgets).any():
                    raise self._infeasible(budgets, time_cap, "infeasible", error_cap)
        return alloc

    def _solve(self, budgets: np.ndarray, objective: str, time_cap: Optional[float], time_limit: Optional[float],
               error_cap: Optional[float], tie_limit: Optional[float] = None) -> Allocation:
        m = self._model
        m.rows(objective)
        if (self.problem.peak_floor() > budgets).any():
            raise self._infeasible(budgets, time_cap, "the optimizer step alone exceeds the budget", error_cap)
        if objective == "error" and error_cap is not None:
            # the least error either meets the cap or nothing does
            alloc = self._solve(budgets, "error", time_cap, time_limit, None, tie_limit)
            if alloc.grad_error > error_cap * (1 + 1e-9):
                raise self._infeasible(budgets, time_cap, "the least error that fits exceeds the error cap", error_cap)
            return alloc
        if objective == "time" and time_cap is not None:
            # the least time either meets the cap or nothing does: solve without it (stages may then separate)
            alloc = self._solve(budgets, "time", None, time_limit, error_cap, tie_limit)
            if alloc.step_seconds > time_cap * (1 + 1e-9):
                raise self._infeasible(budgets, time_cap, "the fastest choice that fits exceeds the time cap", error_cap)
            return alloc
        if error_cap is not None:  # objective time under an error cap: the cap couples the stages
            res = m.solve(budgets, objective, None, time_limit, error_cap, tie_limit)
            if res.x is None:
                raise self._infeasible(budgets, None, res.message, error_cap)
            return m.allocation(res.x, getattr(res, "second_gap", 0.0), getattr(res, "gap", 0.0))
        if time_cap is not None and self.problem.num_stages > 1:
            first = m.solve_first_objective(budgets, objective, time_cap, time_limit)
            if first.x is None:
                raise self._infeasible(budgets, time_cap, first.message)
            if m.value(first.x, objective) <= 0.0 and not (m.rows(objective)[0] < 0).any():
                # zero error is reachable within the cap: the least time at zero error is below the cap too,
                # and without the cap the stages separate
                return self._solve(budgets, objective, None, time_limit, None, tie_limit)
            if not self.tie_break:
                return m.allocation(first.x, 1.0, primary_gap(first))
            res = m.solve_second_objective(first, budgets, objective, time_cap, tie_limit)
            return m.allocation(res.x, res.second_gap, primary_gap(first))
        if time_cap is None and self.problem.num_stages > 1:
            x = np.zeros(m.nv)
            gap = first_gap = 0.0
            for s, (model, idx, layers) in enumerate(self._stage_solvers()):
                res = model.solve(budgets[s:s + 1], objective, None, time_limit, None, tie_limit)
                if res.x is None:
                    raise self._infeasible(budgets, time_cap, f"stage {s}: {res.message}")
                sx = np.round(res.x)
                gap = max(gap, getattr(res, "second_gap", 0.0))
                first_gap = max(first_gap, getattr(res, "gap", 0.0))
                x[idx] = sx[:model.n]
                for offset, sub_offset in ((m.c0, model.c0), (m.u0, model.u0), (m.w0, model.w0)):
                    x[offset + layers] = sx[sub_offset:sub_offset + len(layers)]
            return m.allocation(x, gap, first_gap)
        res = m.solve(budgets, objective, time_cap, time_limit, None, tie_limit)
        if res.x is None:
            raise self._infeasible(budgets, time_cap, res.message)
        return m.allocation(res.x, getattr(res, "second_gap", 0.0), getattr(res, "gap", 0.0))

    explain = True  # False: an infeasible solve says so without solving for the smallest budget (seconds of work)

    def _infeasible(self, budgets: np.ndarray, time_cap: Optional[float], why: str,
                    error_cap: Optional[float] = None) -> InfeasibleBudget:
        if not self.explain:
            return InfeasibleBudget(f"no choice fits the budget ({why})", None)
        smallest = self.smallest_budget(time_cap, error_cap)
        if smallest is None:
            if error_cap is not None and self.smallest_budget(None, error_cap) is None:
                least = self.solve(np.full(self.problem.num_stages, np.inf), "error").grad_error
                return InfeasibleBudget(f"no choice has a gradient error <= {error_cap:.4g} at any memory budget; the "
                                        f"least is {least:.4g}", None, ("error_cap",))
            fastest = self.smallest_time()
            return InfeasibleBudget(f"no choice meets the time cap of {time_cap:.4f} s per step at any memory budget"
                                    f"{' within the error cap' if error_cap is not None else ''}; the fastest choice "
                                    f"takes {fastest:.4f} s", None, ("time_cap",))
        asked = ", ".join(format_bytes_apart(b, smallest)[0] for b in budgets)  # enough digits to tell them apart
        caps = "".join([f" within the time cap of {time_cap:.4f} s" if time_cap is not None else "",
                        f" and error cap {error_cap:.4g}" if error_cap is not None else ""])
        return InfeasibleBudget(
            f"no choice fits a budget of {asked} per stage{caps}: the smallest feasible budget is "
            f"{format_bytes_apart(smallest, min(budgets))[0]} ({smallest} bytes)"
            + ("" if "infeasible" in why.lower() else f" ({why})"), smallest)

    def smallest_time(self) -> float:
        """Seconds per step of the fastest choice, memory aside."""
        alloc = self.solve(np.full(self.problem.num_stages, np.inf), objective="time")
        return alloc.step_seconds


def solve(problem: ChoiceProblem, budget, objective: str = "error", time_cap: Optional[float] = None,
          error_cap: Optional[float] = None) -> Allocation:
    """Solve one problem at one budget (bytes per stage); see `Solver.solve`."""
    return Solver(problem).solve(budget, objective, time_cap, error_cap=error_cap)


def resolve_error_cap(problem: ChoiceProblem, error_cap) -> Optional[float]:
    """The gradient-error cap as a number: `error_cap` itself (a number or None), or for "recipe" the
    predicted error of the published LAAQ recipe on this problem (agoq-paper at the stage rule's bits)."""
    if error_cap != RECIPE_CAP:
        return error_cap
    value = recipe_error(problem)
    if value is None:
        raise ValueError("an error cap of 'recipe' needs the recipe's options in the profile (4 bits, recompute and "
                         "16 for every kind, at the stage rule's widths): profile those bit widths or give the "
                         "cap as a number")
    return value


def checkpointing_seconds(problem: ChoiceProblem, budget) -> Optional[float]:
    """Predicted step seconds of the fastest full-or-selective checkpointing (each layer kept whole or
    checkpointed) that fits `budget` bytes per stage; None when even full checkpointing does not fit."""
    try:
        return Solver(checkpointing_only(problem)).solve(budget, "time").step_seconds
    except InfeasibleBudget:
        return None


def resolve_time_cap(problem: ChoiceProblem, budget, time_cap) -> Optional[float]:
    """Seconds for a time cap given as seconds, None, or "checkpoint" (no slower than the best checkpointing
    configuration that fits the budget; no cap when none fits)."""
    if time_cap == CHECKPOINT_CAP:
        seconds = checkpointing_seconds(problem, budget)
        return None if seconds is None else seconds * (1 + 1e-9) + 1e-12
    return time_cap
