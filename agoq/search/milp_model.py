"""The exact per-layer choice as a mixed-integer program (HiGHS, agoq.search.highs): its lexicographic solve,
over the matrices of agoq.search.milp_rows (its variables and constraint rows, built once per problem), and the
Allocation it gives. `agoq.search.milp.Solver` asks it questions.

Objective: gradient error (ties broken by time) or step time (ties broken by error), lexicographically: the
first objective is solved to within FIRST_GAP of its optimum (3e-3 relative: 0.8 ms of the H100 probe's 264 ms
eager step) or, where HiGHS cannot prove that within the time limit it is given (agoq.search.milp.PRIMARY_SECONDS),
the best choice found by then, with `Allocation.gap` the relative gap left; the second is then minimised exactly
(relative gap 1e-7) among the choices that reach the first's value, a set that holds every exact optimum, and among
those the one that changes fewest tensors (quantized or recomputed options, checkpointed layers): where keeping a
tensor as it is costs nothing, it is kept. When the first optimum is zero (zero error at a loose budget) that
second solve is the real trade-off: the least time at zero error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult

from agoq.runtime.activations.policy import KINDS
from agoq.search.highs import WarmLP, milp
from agoq.search.milp_levels import Levels, count_priced
from agoq.search.milp_neighbourhood import near_relaxation
from agoq.search.milp_offload import Enumeration
from agoq.search.milp_rows import OBJECTIVES, Rows, dominated_options
from agoq.search.milp_uniform import tie_break
from agoq.search.problem import ChoiceProblem

__all__ = ["Allocation", "Model", "primary_gap", "dominated_options", "OBJECTIVES", "FIRST_GAP", "GAP",
           "CHANGE_WEIGHT"]

CHANGE_WEIGHT = 1e-4  # the second solve's weight of one tensor not kept as it is
GAP = 1e-7  # relative MIP gap of the second objective (the tie-break) and the least peak: optimal
# The first objective's relative MIP gap. HiGHS finds the optimum early and spends the rest proving it: on the H100
# probe profile's smallest budget the eager QuanGrad problem's MILP took 0.39 s at 1e-7 and 0.07 s at 1e-4, with the
# same answer; with an offloaded layer's backward priced, the smallest budget's prefix MILP and its tie-break took
# 0.42 and 0.44 s at 1e-4 and under 0.05 s at 3e-3. 3e-3 of a step is 0.4-0.8 ms, a fraction of what measured steps
# spread (1-5 %): at 40 budgets over four profiles the plans were the same but one, 0.02 ms slower and with less
# error. The tie-break then admits every choice as fast as the one found (every exact optimum among them), and a
# plan shows a gap left only where a time limit stopped the solve (agoq.search.plan_builder).
FIRST_GAP = 3e-3
START = True  # a prefix whose neighbourhood's choice is not certified solved from that choice (highs.milp's initial)
NEAR = True  # each offloaded prefix first solved near its relaxation (agoq.search.milp_neighbourhood); False: whole


@dataclass
class Allocation:
    """A solved choice: the option index chosen per (layer, kind), checkpointed layers, and its costs."""

    chosen: np.ndarray        # option indices
    checkpoint: np.ndarray    # bool per layer
    peak_bytes_per_stage: list
    step_seconds: float
    grad_error: float
    activation_bytes_per_stage: Optional[list] = None  # what the layers keep (peak less the static part)
    second_gap: float = 0.0   # MIP gap left on the second objective (0: proven optimal)
    gap: float = 0.0          # MIP gap left on the first objective when its time limit stopped it (0: proven)
    offload: Optional[np.ndarray] = None  # bool per layer: saved tensors kept in host memory (None: none)
    host_bytes: int = 0       # what the offloaded layers keep on the host, per micro-batch
    offload_link_seconds: float = 0.0  # the host link's time per micro-batch, out and back

    def offloaded(self) -> np.ndarray:
        return np.zeros(len(self.checkpoint), dtype=bool) if self.offload is None else np.asarray(self.offload, bool)

    def settings(self, problem: ChoiceProblem) -> list[dict]:
        """Per layer: {'checkpoint': bool, 'kinds': {kind: setting}} in Plan form."""
        out = [{"checkpoint": bool(c), "kinds": {k: 16 for k in KINDS}} for c in self.checkpoint]
        for l, off in enumerate(self.offloaded()):
            if off:
                out[l]["offload"] = True
        for i in self.chosen:
            l, kind, opt = int(problem.layer[i]), KINDS[int(problem.kind[i])], problem.option[i]
            out[l]["kinds"][kind] = opt if opt == "recompute" else int(opt)
        return out


class Model(Rows):
    """The MILP of one problem (agoq.search.milp_rows) and its solves; budgets and objective are given per solve."""

    def __init__(self, p: ChoiceProblem):
        super().__init__(p)
        self._first: dict = {}  # first-objective results by (budgets, objective, caps, time limit)
        self._no_prefix: dict = {}  # (time cap, error cap) -> [(budget, offloaded prefixes with no relaxed choice)]
        self.levels = Levels(self) if count_priced(self) else None  # step time as a count (agoq.search.milp_levels)

    def solve_first_objective(self, budgets: np.ndarray, objective: str, time_cap: Optional[float],
                              time_limit: Optional[float] = None, error_cap: Optional[float] = None,
                              patient: bool = True):
        """The exact optimum of the first objective (scipy's OptimizeResult; x None when infeasible). Where
        `time_limit` stops the search before any choice is found, it searches on (the whole MILP, without the
        limit), unless not `patient`: then x None and status 1 (none found in time)."""
        key = (np.asarray(budgets, float).tobytes(), objective, time_cap, time_limit, error_cap, patient)
        if key in self._first:  # solved already (first objective alone, then again with its ties broken)
            return self._first[key]
        if objective == "time" and time_cap is None and self.levels is not None:
            res = self.levels.fastest(budgets, error_cap, time_limit)
            if res is not None:
                return self._keep_first(key, res)
            if not patient:
                return _stopped(time_limit)
            # the time limit came before a level was settled: the whole MILP, for as long again, keeps its best found
        primary, _ = self.rows(objective)
        scale = max(float(np.abs(primary).max()), 1e-30)
        options = {"mip_rel_gap": FIRST_GAP, **({"time_limit": time_limit} if time_limit else {})}
        args = dict(constraints=self.constraints(budgets, time_cap, error_cap), integrality=self.integrality,
                    bounds=self.bounds)
        if self.offload:  # one MILP per offloaded prefix: each far smaller than the whole (seconds on the probe)
            # a prefix with no relaxed choice at a budget has none at a smaller one (only the memory rows' right-hand
            # sides move with the budget): a front, solved largest budget first, skips them
            budget, known = float(budgets[0]), self._no_prefix.setdefault((time_cap, error_cap), [])
            ruled_out = set().union(*[ks for b, ks in known if b >= budget])
            visit = [k for k in range(self.L + 1) if k not in ruled_out]
            res = self.over_prefixes(primary / scale, args["constraints"], self.bounds, options, time_limit, visit)
            if res is not None:
                known.append((budget, frozenset(visit) - set(res.bounds_by_prefix)))
                del known[:-64]  # a long-lived solver (the dashboard's service) keeps its last answers only
                return self._keep_first(key, res)
            if not patient:
                return _stopped(time_limit)
        res = milp(primary / scale, options=options, **args)
        if res.x is None and res.status == 1 and patient:  # the time limit came before any choice: search on
            res = milp(primary / scale, options={"mip_rel_gap": FIRST_GAP}, **args)
        if res.x is None and res.status == 2 and self.offload:
            # HiGHS's presolve can misjudge offload's big-M rows as infeasible where a choice meets them exactly
            # (a budget equal to its peak): asked again without it
            res = milp(primary / scale, options={**options, "presolve": False}, **args)
        return self._keep_first(key, res)

    def over_prefixes(self, c: np.ndarray, constraints: list, bounds: Bounds, options: dict,
                      time_limit: Optional[float], prefixes=None, integrality: Optional[np.ndarray] = None,
                      cutoff: float = np.inf) -> Optional[OptimizeResult]:
        """min c x over the MILP's choices (`constraints`, `bounds`), one offloaded prefix at a time.

        Offload is a prefix (o_{l+1} <= o_l): every choice offloads layers 0..K-1 for one K in 0..L, so the
        optimum is the least of the L + 1 MILPs with the o_l fixed, in which offload's big-M rows are plain
        bounds. Each K's linear relaxation bounds its MILP from below: the prefixes are solved best bound first,
        and one whose bound cannot beat the best found (within the MIP gap) is not solved. As exact as the whole
        MILP (within `options`' mip_rel_gap); seconds faster where layers may each take their own setting (eager
        plans). Where `time_limit` (seconds for the prefixes' MILPs, their relaxations not counted) stops it, the best choice found by then (status 1,
        `mip_gap` from the least bound not settled); None where it stopped before any choice or HiGHS gave no
        relaxation: the caller then solves the whole MILP. An OptimizeResult with x None and status 2 when no
        prefix has a choice. `prefixes` (None: all) limits the K visited to those known to hold every choice that
        can meet the constraints; the result's `bounds_by_prefix` gives each K's relaxed optimum (K without a
        relaxed choice left out). `integrality` (default the model's) covers columns after the model's own too:
        the least peak's bound (agoq.search.milp_least). Only a choice with c x under `cutoff` is looked for:
        prefixes whose relaxation is no lower are not solved (none found: status 2)."""
        integrality = self.integrality if integrality is None else integrality
        gap = float(options.get("mip_rel_gap", GAP))  # a prefix must beat the best found by more than this
        ranked = self.relaxed_prefixes(c, constraints, bounds, prefixes)
        if ranked is None:
            return None
        # the time limit bounds the MILPs, not the relaxations before them (a small LP per prefix): on a
        # loaded 2-core machine those took most of the 0.3 s a binding constraint's question is given and left its MILP
        # none, so the answer changed with the load (the H200 probe's tightest budget, 1 of 5 requests)
        start = time.perf_counter()

        def time_left() -> Optional[dict]:  # `options` with the MILPs' time left, None once it is spent
            if time_limit is None:
                return dict(options)
            left = time_limit - (time.perf_counter() - start)
            return None if left <= 0 else {**options, "time_limit": left}

        best, best_value = None, cutoff
        unsettled = np.inf  # the least bound of a prefix the time limit left unsolved or unproven
        for bound, _k, fixed, relaxed_x in sorted(ranked, key=lambda t: (t[0], t[1])):
            if bound >= best_value - gap * abs(best_value):
                break  # neither this prefix nor any after it (their bounds are no lower) can do better
            opts = time_left()
            near = near_relaxation(self, c, constraints, fixed, relaxed_x, bound, gap, opts,
                                   integrality) if NEAR and opts else None
            res = near if near is not None and near.certified else None
            if res is None:  # not certified near its relaxation: the whole prefix, from the neighbourhood's choice
                opts = time_left()
                if opts is None:
                    unsettled = min(unsettled, bound)
                    break
                # without HiGHS's presolve: with it, one prefix of a test problem (seed 300 of test_milp_offload's
                # brute force) was reported optimal at 0.0946 of error where 0.0914 fitted; interleaved with it on the
                # probe profiles' tightest budgets a request took 1.65-2.0 s against 1.45-1.68 s (H100) and 2.8-4.5 s
                # against 3.8-5.8 s (H200). Each way can call a choice that meets a row exactly infeasible: then the
                # other is asked
                res = milp(c, constraints=constraints, integrality=integrality, bounds=fixed,
                           options={**opts, "presolve": False}, initial=near.x if near is not None and START else None)
            if res.x is None and res.status == 2:
                res = milp(c, constraints=constraints, integrality=integrality, bounds=fixed, options=opts)
            if res.x is None:
                if res.status == 2:
                    continue
                unsettled = min(unsettled, bound)  # stopped by the time limit before any choice
                break
            if res.status != 0:  # a choice, not proven optimal in time
                unsettled = min(unsettled, bound)
            value = float(c @ self.rounded(res.x))
            if value < best_value:
                best, best_value = res, value
        if best is None:
            if np.isfinite(unsettled):
                return None  # the time limit came before any choice: the caller's whole MILP searches on
            best = OptimizeResult(x=None, status=2, success=False, fun=None, mip_gap=None,
                                  message="no choice fits the budget and the caps (every offloaded prefix checked)")
        elif unsettled < best_value - gap * abs(best_value):  # the best found by the time limit, and its gap
            best.status, best.success = 1, False
            best.mip_gap = float((best_value - unsettled) / max(abs(best_value), 1e-30))
        else:
            best.status, best.success, best.mip_gap = 0, True, 0.0
        best.bounds_by_prefix = {k: bound for bound, k, _, _ in ranked}
        return best

    def relaxed_prefixes(self, c: np.ndarray, constraints: list, bounds: Bounds, prefixes=None) -> Optional[list]:
        """[(relaxed optimum, K, the bounds with layers 0..K-1 offloaded and the rest not, relaxed x)] for each K
        of `prefixes` (None: 0..L) whose linear relaxation has a choice: one HiGHS LP, each K solved from the last
        one's basis (agoq.search.highs.WarmLP). None where HiGHS gives no answer for one."""
        visits = []
        for k in range(self.L + 1) if prefixes is None else sorted(prefixes):
            lb, ub = bounds.lb.copy(), bounds.ub.copy()
            on, off = slice(self.o0, self.o0 + k), slice(self.o0 + k, self.o0 + self.L)
            if (ub[on] < 1).any() or (lb[off] > 0).any():
                continue  # a layer that cannot be offloaded in the prefix, or one that must be above it
            lb[on], ub[on], lb[off], ub[off] = 1.0, 1.0, 0.0, 0.0
            visits.append((k, Bounds(lb, ub)))
        ranked, lp = [], WarmLP(c, constraints)
        for k, fixed in visits:
            relaxed = lp.solve(fixed)
            if relaxed.status == 2:
                continue  # not even the relaxation fits: no choice offloads exactly these layers
            if relaxed.x is None:
                return None
            ranked.append((float(c @ relaxed.x), k, fixed, relaxed.x))
        return ranked

    def _keep_first(self, key, res):
        if len(self._first) >= 16:
            self._first.pop(next(iter(self._first)))
        self._first[key] = res
        return res

    def solve_second_objective(self, first, budgets: np.ndarray, objective: str, time_cap: Optional[float],
                               tie_limit: Optional[float] = None, error_cap: Optional[float] = None):
        """Among the choices reaching `first`'s optimum, the best second objective, then the least memory."""
        primary, secondary = self.rows(objective)
        best = self.value(first.x, objective)
        sec_scale = max(float(np.abs(secondary).max()), 1e-30)
        changes = np.zeros(self.nv)  # tensors not kept as they are: quantized or recomputed options, checkpointed layers
        changes[:self.n] = ~self.p.keeps_16bit()
        changes[self.c0:self.c0 + self.L] = 1.0
        if self.offload:
            changes[self.o0:self.o0 + self.L] = 1.0  # a layer offloaded
        # HiGHS stops within an absolute gap of 1e-6: the second objective (its largest coefficient 1e3) and the
        # changed tensors (1e-4 each) are scaled so that one changed tensor is well above it
        c = 1e3 * secondary / sec_scale + CHANGE_WEIGHT * changes
        options = {"mip_rel_gap": GAP, **({"time_limit": tie_limit} if tie_limit else {})}
        bounds = self.bounds
        if best <= 0.0 and not (primary < 0).any():  # the optimum uses no option with a primary cost: fix those out
            bounds = Bounds(bounds.lb, np.where(primary > 0, 0.0, bounds.ub))
            extra = []
            if objective == "error":
                time_cap = None  # minimising time among choices the cap allowed: the cap cannot bind
        else:  # ties among the optimum's equals
            seconds = best + self.time_constant
            if objective == "time" and self.levels is not None and self._ties_keep_every_layer(first.x, seconds):
                # compiled, alike layers: enumerated, not searched (agoq.search.milp_uniform)
                quick = tie_break(self, seconds, self.levels.tied_counts(seconds), budgets, error_cap,
                                  1e3 / sec_scale, CHANGE_WEIGHT)
                if quick is not None:
                    quick.second_gap = 0.0
                    return quick
            elif objective == "time" and time_cap is None and self.levels is not None:
                enumeration = Enumeration.build(self)  # alike layers with an offloaded prefix: enumerated too
                quick = None if enumeration is None else enumeration.tie_break(
                    best, budgets, error_cap, 1e3 / sec_scale, CHANGE_WEIGHT)
                if quick is not None:
                    quick.second_gap = 0.0
                    return quick
            scale = max(float(np.abs(primary).max()), 1e-30)
            extra = [LinearConstraint(primary[None, :] / scale, -np.inf, (best + abs(best) * 1e-9 + 1e-12) / scale)]
        # the first answer meets every row here, so its own value bounds the second solve from above: told so, HiGHS
        # prunes from the start (on the H100 probe's smallest budget its time to prove the tie-break varied
        # 0.30-0.66 s with the last bits of the time row's right-hand side; 0.30 s with this row)
        c_scale = max(float(np.abs(c).max()), 1e-30)
        ceiling = float(c @ self.rounded(first.x)) / c_scale
        cutoff = LinearConstraint(c[None, :] / c_scale, -np.inf, ceiling + abs(ceiling) * 1e-9 + 1e-9)
        rows = self.constraints(budgets, time_cap, error_cap) + extra
        cons = rows + [cutoff]
        second = None
        if self.offload:  # the prefixes whose relaxed first objective reaches the optimum hold every tie
            known = getattr(first, "bounds_by_prefix", None)
            if known is not None and extra:
                top = best + abs(best) * 1e-9 + 1e-12
                known = {k for k, bound in known.items() if bound * scale <= top + abs(top) * 1e-6}
            second = self.over_prefixes(c, cons, bounds, options, tie_limit, known if extra else None)
        if second is None:
            second = milp(c, constraints=cons, integrality=self.integrality, bounds=bounds, options=options)
        if second.x is None and second.status == 2:
            # the first answer meets these rows, so "infeasible" is HiGHS's presolve misjudging (seen with offload's
            # big-M rows) or the cutoff's tolerance: solved again without either
            second = milp(c, constraints=rows, integrality=self.integrality, bounds=bounds,
                          options={**options, "presolve": False})
        if second.x is None:  # cannot happen (the first answer is feasible); kept as the answer if it does
            first.second_gap = 1.0
            return first
        second.second_gap = 0.0 if second.status == 0 else float(getattr(second, "mip_gap", 1.0) or 0.0)
        return second

    def _ties_keep_every_layer(self, x: np.ndarray, seconds: float) -> bool:
        """Whether every choice as fast as `x` (`seconds` a step) keeps every layer on the GPU: no offload is
        offered, or `x` offloads nothing and the least offload (layer 0's least bytes) costs more than the tie
        tolerance (faster levels that would have to offload were ruled out by the levels' search)."""
        if not self.offload:
            return True
        if np.round(x[self.o0:self.o0 + self.L]).any():
            return False
        return self.levels.link_seconds(self.levels.first_layer_bytes) > abs(seconds) * 1e-9 + 1e-12

    tie_break = True  # False: the first objective only (its ties left unbroken, second_gap 1)

    def solve(self, budgets: np.ndarray, objective: str, time_cap: Optional[float],
              time_limit: Optional[float] = None, error_cap: Optional[float] = None,
              tie_limit: Optional[float] = None):
        """Lexicographic: the first objective exactly, then the second (see the module docstring)."""
        first = self.solve_first_objective(budgets, objective, time_cap, time_limit, error_cap)
        if first.x is None:
            return first
        if not self.tie_break:
            first.second_gap, first.gap = 1.0, primary_gap(first)
            return first
        res = self.solve_second_objective(first, budgets, objective, time_cap, tie_limit, error_cap)
        res.gap = primary_gap(first)
        return res

    def allocation(self, x: np.ndarray, second_gap: float = 0.0, gap: float = 0.0) -> Allocation:
        x = np.round(x).astype(int)
        chosen = np.nonzero(x[:self.n])[0]
        ckpt = x[self.c0:self.c0 + self.L].astype(bool)
        off = x[self.o0:self.o0 + self.L].astype(bool) if self.offload else None
        if off is not None and not off.any():
            off = None
        figures = self.p.evaluate(chosen, ckpt, off)
        return Allocation(chosen, ckpt, figures["peak_bytes_per_stage"], figures["step_seconds"],
                          figures["grad_error"], figures["activation_bytes_per_stage"], float(second_gap), float(gap),
                          off, figures["host_bytes"], figures["offload_link_seconds"])

    def improves(self, budgets: np.ndarray, objective: str, value: float, time_cap: Optional[float],
                 error_cap: Optional[float], time_limit: float) -> bool:
        """Whether some choice within `budgets` and the caps has a first objective below `value` (step seconds or
        gradient error), as far as `time_limit` seconds of search find. None does where the linear relaxation's
        optimum is not below it (no solve); else, where the levels answer exactly (compiled plans), their fastest
        choice; else any choice with `value` as one more cap, the first found ending the search (an optimum is not
        asked for). Not searched on past the time limit: False where no choice was found by then."""
        bound = self.relaxed_bound(budgets, objective, time_cap, error_cap)
        if bound is None or bound >= value:
            return False
        if objective == "time" and time_cap is None and self.levels is not None and (
                not self.offload or Enumeration.build(self) is not None):
            res = self.solve_first_objective(budgets, objective, None, time_limit, error_cap, patient=False)
        else:
            if objective == "time":
                time_cap = value if time_cap is None else min(time_cap, value)
            else:
                error_cap = value if error_cap is None else min(error_cap, value)
            # the objective steers HiGHS (and orders the offloaded prefixes, best relaxation first) to a choice
            # below `value`; a gap this wide ends each solve, and the prefixes, at the first choice found
            primary, _ = self.rows(objective)
            c = primary / max(float(np.abs(primary).max()), 1e-30)
            cons, options = self.constraints(budgets, time_cap, error_cap), {"time_limit": time_limit,
                                                                             "mip_rel_gap": 1e9}
            res = self.over_prefixes(c, cons, self.bounds, options, time_limit) if self.offload else milp(
                c, constraints=cons, integrality=self.integrality, bounds=self.bounds, options=options)
        if res is None or res.x is None:
            return False
        found = self.allocation(res.x)
        return (found.grad_error if objective == "error" else found.step_seconds) < value

    def relaxed_bound(self, budgets: np.ndarray, objective: str, time_cap: Optional[float],
                      error_cap: Optional[float]) -> Optional[float]:
        """The optimum of the first objective's linear relaxation (every 0/1 variable in [0, 1]): a lower bound on
        the MILP's (see Solver.relaxed_bound); None when no choice fits, -inf when HiGHS gives no answer."""
        if (self.p.peak_floor() > budgets).any():
            return None
        if objective == "time" and time_cap is None and self.levels is not None and not self.offload:
            return self.levels.relaxed(budgets, error_cap)  # (with offload, the relaxation below bounds bytes too)
        primary, _ = self.rows(objective)
        scale = max(float(np.abs(primary).max()), 1e-30)
        res = milp(primary / scale, constraints=self.constraints(budgets, time_cap, error_cap),
                   integrality=np.zeros(self.nv), bounds=self.bounds)
        if res.status == 2:
            return None
        if res.x is None:
            return -np.inf
        value = float(primary @ res.x)
        return value + self.time_constant if objective == "time" else value


def _stopped(time_limit: Optional[float]) -> OptimizeResult:
    """The answer of an impatient first-objective solve that the time limit stopped before any choice."""
    return OptimizeResult(x=None, status=1, success=False, fun=None, mip_gap=None,
                          message=f"no choice found within the time limit ({time_limit} s)")


def primary_gap(result) -> float:
    """The relative MIP gap a first-objective solve left: 0 when proven optimal, else HiGHS's gap (1: unknown)."""
    if result.status == 0:
        return 0.0
    gap = getattr(result, "mip_gap", None)
    return 1.0 if gap is None or not np.isfinite(gap) else float(gap)
