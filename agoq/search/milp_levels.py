"""The fastest choice when step time is a count: exact, by visiting the possible step times fastest first.

A problem is *count-priced* when its step seconds depend only on how many layers run unmodified (n_u) and how
many are checkpointed (n_c): every option adds 0 s, every layer under LAAQ's functions adds the same
`laaq_layer_seconds`, checkpointing adds the same seconds in every layer, and there is one pipeline stage.
Compiled plans are priced this way (agoq.search.costs: a compiled layer under LAAQ is priced from the measured
agoq step, whatever its bit widths). With L layers and n_a = L - n_u - n_c under LAAQ:

    seconds(n_u, n_c) = time_constant - laaq_layer_seconds x n_u + (checkpoint_seconds - laaq_layer_seconds) x n_c

so there are at most (L + 1)(L + 2) / 2 possible step times ("levels"). The MILP of the whole problem has a weak
linear relaxation here (a fraction of a layer kept whole costs a fraction of a layer's time), and HiGHS can search
for seconds without proving its optimum. Visiting the levels fastest first, with the counts fixed
(sum_l u_l = n_u, sum_l c_l = n_c), the first level some choice meets (memory budget, error cap) is the optimum:

  1. a bound, no solve: the static bytes plus the n_u, n_c and n_a least per-layer bytes of each state
     (unmodified, checkpointed, under LAAQ at its smallest options); no choice with those counts keeps less (each
     state's cheapest layers are taken, even where a layer would count twice). Likewise the n_a least per-layer
     errors (a layer under LAAQ has at least one option not at 16; pairs of options only add to them) against the
     error cap;
  2. the linear relaxation with the counts fixed (milliseconds);
  3. the MILP with the counts fixed and no objective: the first choice that fits settles the level.
  Where the layers are alike, agoq.search.milp_uniform's enumeration of the level's LAAQ settings replaces 2 and 3:
  a choice it finds fits and settles the level; where no setting fits, the level is ruled out.

Answers at other budgets (same cap) are kept: levels faster than the answer at a larger budget are skipped (a
smaller budget never allows more), and the answer at a smaller budget fits, so no level as slow as it needs a solve.
Ties, other levels of the fastest time, are left to the second objective (the error, then fewest changed
tensors), which asks for the time and not the counts, as with the whole MILP. When laaq_layer_seconds is 0 and u_l is not needed exactly, the
levels are the counts of checkpointed layers alone.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult

from agoq.search.highs import milp
from agoq.search.memory_phases import PHASES, phase_sum
from agoq.search.milp_offload import Enumeration
from agoq.search.milp_uniform import tie_break

RELATIVE = 1e-9  # two levels whose seconds differ by less than this (relative) are the same time


def count_priced(model) -> bool:
    """Whether `model`'s problem (agoq.search.milp_model.Model) has step seconds that depend only on its counts."""
    p = model.p
    if p.num_stages != 1 or len(p.seconds) == 0 or np.any(p.seconds != 0.0):
        return False
    if p.allow_checkpoint and np.ptp(p.checkpoint_seconds) > 1e-12 * max(1.0, float(np.abs(p.checkpoint_seconds).max())):
        return False
    return model.u_exact or p.laaq_layer_seconds == 0.0


def levels(model) -> list[tuple[float, Optional[int], int]]:
    """(seconds, n_u or None when u is free, n_c), fastest first; ties in the order of fewer changed layers."""
    p, L = model.p, model.L
    ckpt = float(p.checkpoint_seconds[0]) if p.allow_checkpoint and L else 0.0
    laaq = p.laaq_layer_seconds
    counts_c = range(L + 1) if p.allow_checkpoint else range(1)
    out = []
    for n_c in counts_c:
        if laaq == 0.0 and not model.u_exact:
            out.append((model.time_constant + ckpt * n_c, None, n_c))
            continue
        for n_u in range(L - n_c + 1):
            out.append((model.time_constant - laaq * n_u + (ckpt - laaq) * n_c, n_u, n_c))
    return sorted(out, key=lambda t: (t[0], -(t[1] or 0), t[2]))


class Levels:
    """The level search for one count-priced Model (its per-state bounds built once)."""

    def __init__(self, model):
        self.m = model
        p, L = model.p, model.L
        self.levels = levels(model)
        is16 = p.keeps_16bit()
        unmod_cal = np.zeros(L) if p.unmodified_calibration is None else np.asarray(p.unmodified_calibration, float)
        ckpt_cal = np.zeros(L) if p.checkpoint_calibration is None else np.asarray(p.checkpoint_calibration, float)
        least_a = np.zeros(L)      # bytes of a layer under LAAQ at its smallest options (less the shared credit)
        sixteen = np.zeros(L)      # bytes of the layer's options at 16
        least_err = np.full(L, np.inf)  # the least error of a layer under LAAQ (one option not at 16)
        modifiable = np.zeros(L, dtype=bool)  # layers with an option not at 16: the only ones that can be under LAAQ
        for (l, _k), idx in model.groups.items():
            least_a[l] += float(p.memory[idx].min())
            sixteen[l] += float(p.memory[idx][is16[idx]].sum())
            other = idx[~is16[idx]]
            if len(other):
                least_err[l] = min(least_err[l], float(p.error[other].min()))
                modifiable[l] = True
        # more layers under LAAQ than can be is no choice; the linear relaxation does not see it (u_l >= 1 - K c_l
        # lets half-checkpointed layers off): with every option at 16 (the checkpointing alternatives) it found
        # ~50 such levels feasible on the H100 probe profile's largest budget, and a MILP proved each infeasible
        self.most_under_laaq = int(modifiable.sum())
        least_a -= p.shared_credit
        self.state_bytes = {  # per state, its per-layer bytes in ascending order, as prefix sums
            "u": np.concatenate([[0.0], np.cumsum(np.sort(sixteen + p.unmodified_extra + unmod_cal - p.shared_credit))]),
            "c": np.concatenate([[0.0], np.cumsum(np.sort(p.checkpoint_memory + ckpt_cal))]),
            "a": np.concatenate([[0.0], np.cumsum(np.sort(least_a))]),
        }
        least_err[~np.isfinite(least_err)] = 0.0
        self.least_error = np.concatenate([[0.0], np.cumsum(np.sort(least_err))])
        self.settled: dict = {}  # error cap -> [(budget, fastest seconds, its choice)] answered so far
        self.offload = p.offload if getattr(model, "offload", False) else None
        if self.offload is not None:  # the least bytes layer 0 keeps (the first to leave when any layer does)
            self.first_layer_bytes = max(0.0, float(min(least_a[0], sixteen[0] + p.unmodified_extra[0] + unmod_cal[0]
                                                        - p.shared_credit[0])))
            lb, ub = model.bounds.lb.copy(), model.bounds.ub.copy()
            ub[model.o0:model.o0 + L] = ub[model.g0:model.g0 + L] = 0.0
            ub[model.h] = ub[model.e] = ub[model.k] = 0.0
            self.kept_bounds = Bounds(lb, ub)  # every layer's saved tensors kept on the GPU, no link time

    def link_seconds(self, offloaded: float) -> float:
        """The least step seconds offloading `offloaded` bytes per micro-batch adds (ChoiceProblem.offload_seconds,
        one layer's own time: at least one layer leaves): 0 at 0, non-decreasing."""
        return self.m.p.offload_seconds(offloaded, 1)["seconds"]

    def _least_bytes(self, n_u: int, n_c: int) -> float:
        """The least bytes a choice with these counts keeps at the end of forward (static bytes included): the
        phase's value (agoq.search.memory_phases) at each state's least bytes, nothing offloaded."""
        n_a = self.m.L - n_u - n_c
        b = self.state_bytes
        least = {"activations": (b["u"][n_u], b["c"][n_c], b["a"][n_a]), "calibration": (),  # calibration: in b
                 "laaq_transient": float(self.m.p.laaq_transient()[0]) if n_a > 0 else 0.0, "offload_backlog": 0.0}
        return float(phase_sum(PHASES[0], float(self.m.p.static_bytes[0]), least.get))

    def _known(self, budget: float, error_cap: Optional[float], settled: dict) -> tuple[float, Optional[tuple]]:
        """From the answers at other budgets (same cap): the fastest seconds at a budget at least as large (no
        faster level fits a smaller budget), and the fastest answer at a budget no larger (it fits this one too)."""
        done = settled.get(error_cap, ())
        floor = max((t for b, t, _ in done if b >= budget), default=-np.inf)
        fits = min(((t, x) for b, t, x in done if b <= budget), key=lambda tx: tx[0], default=None)
        return floor, fits

    def _bound_fails(self, budget: float, n_u: Optional[int], n_c: int, error_cap: Optional[float]) -> bool:
        """True when no choice with these counts, every layer kept on the GPU, can meet the budget or the error cap
        (step 1 of the docstring)."""
        if n_u is None:  # u free: only the checkpointed layers' count is known
            return False
        n_a = self.m.L - n_u - n_c
        if n_a > self.most_under_laaq or self._least_bytes(n_u, n_c) > budget * (1 + RELATIVE) + 1.0:
            return True
        return error_cap is not None and self.least_error[n_a] > error_cap * (1 + RELATIVE) + 1e-15

    def _count_rows(self, n_u: Optional[int], n_c: int) -> LinearConstraint:
        m = self.m
        rows = np.zeros((2, m.nv))
        rows[0, m.c0:m.c0 + m.L] = 1.0
        lo = [n_c, -np.inf]
        hi = [n_c, np.inf]
        if n_u is not None:
            rows[1, m.u0:m.u0 + m.L] = 1.0
            lo[1] = hi[1] = n_u
        return LinearConstraint(rows, lo, hi)

    def tied_counts(self, seconds: float) -> list[tuple[Optional[int], int]]:
        """(n_u, n_c) of every level whose step time is `seconds` (within RELATIVE): a choice without offload is as
        fast as `seconds` exactly when its counts are one of them."""
        return [(n_u, n_c) for t, n_u, n_c in self.levels if abs(t - seconds) <= abs(seconds) * RELATIVE + 1e-15]

    def relaxed(self, budgets: np.ndarray, error_cap: Optional[float]) -> Optional[float]:
        """A lower bound on the fastest step, with no solve: the first level that passes the bound of step 1 (None:
        no level does, so no choice fits). Weaker than the levels' linear relaxations, and free."""
        for seconds, n_u, n_c in self.levels:
            if not self._bound_fails(float(budgets[0]), n_u, n_c, error_cap):
                return seconds
        return None

    def fastest(self, budgets: np.ndarray, error_cap: Optional[float],
                time_limit: Optional[float]) -> Optional[OptimizeResult]:
        """The exact fastest choice (scipy's OptimizeResult, status 0; x None and status 2 when nothing fits), or
        None when `time_limit` seconds ran out before a level was settled, or layers may be offloaded where
        `_fastest_offloading`'s enumeration does not hold (the caller then solves the MILP)."""
        if self.offload is not None:
            return self._fastest_offloading(budgets, error_cap, time_limit)
        return self._fastest_kept(budgets, error_cap, time_limit, self.m.bounds, self.settled)

    def _fastest_kept(self, budgets: np.ndarray, error_cap: Optional[float], time_limit: Optional[float], bounds,
                      settled: dict) -> Optional[OptimizeResult]:
        """`fastest` over the choices `bounds` allows (the model's, or with offload every layer kept on the GPU),
        its answers at other budgets kept in `settled`."""
        m = self.m
        start = time.perf_counter()
        cons = m.constraints(budgets, None, error_cap)
        found, found_seconds = None, None
        floor, fits = self._known(float(budgets[0]), error_cap, settled)
        for seconds, n_u, n_c in self.levels:
            if seconds < floor - abs(floor) * RELATIVE:
                continue
            if fits is not None and seconds >= fits[0] - abs(fits[0]) * RELATIVE:
                found, found_seconds = OptimizeResult(x=fits[1].copy()), fits[0]  # no faster level fits: it is the answer
                break
            if self._bound_fails(float(budgets[0]), n_u, n_c, error_cap):
                continue
            # alike layers: the level's LAAQ settings enumerated (agoq.search.milp_uniform) find a choice that fits,
            # or show that none does, without the relaxation or a feasibility solve (half a second on the probe)
            res = tie_break(m, seconds, [(n_u, n_c)], budgets, error_cap, 1.0, 0.0, prove_none=True) \
                if n_u is not None else None
            if res is not None and res.x is None:
                continue  # no choice of the level fits: every LAAQ setting was enumerated
            if res is None:
                counts = self._count_rows(n_u, n_c)
                relaxed = milp(np.zeros(m.nv), constraints=cons + [counts], integrality=np.zeros(m.nv), bounds=bounds)
                if relaxed.status == 2:
                    continue
                left = None if time_limit is None else time_limit - (time.perf_counter() - start)
                if left is not None and left <= 0:
                    return None
                res = milp(np.zeros(m.nv), constraints=cons + [counts], integrality=m.integrality, bounds=bounds,
                           options={} if left is None else {"time_limit": left})
            if res.x is not None:  # the fastest level; its ties, other levels of the same time, are the second
                found, found_seconds = res, seconds  # objective's to weigh (it asks for the time, not the counts)
                break
            if res.status != 2:  # stopped by the time limit (or HiGHS gave up) before settling this level
                return None
        if found is None:
            return OptimizeResult(x=None, status=2, success=False, fun=None, mip_gap=None,
                                  message="no choice fits the budget and the caps (every step-time level checked)")
        found.status, found.success, found.mip_gap = 0, True, 0.0
        settled.setdefault(error_cap, []).append((float(budgets[0]), found_seconds, np.round(found.x)))
        found.message = "optimal: the fastest step-time level that some choice meets"
        found.seconds = found_seconds
        return found

    def _fastest_offloading(self, budgets: np.ndarray, error_cap: Optional[float],
                            time_limit: Optional[float]) -> Optional[OptimizeResult]:
        """`fastest` where layers may be offloaded and are alike in a compiled plan (agoq.search.milp_offload):
        the fastest choice keeping every layer on the GPU (the levels, offload fixed off) is the answer to beat,
        and every configuration that offloads is enumerated against it, exactly. None where that structure does
        not hold, or the kept choice was not settled within `time_limit`: the caller then solves one MILP per
        offloaded prefix (agoq.search.milp_model.Model.over_prefixes)."""
        enumeration = Enumeration.build(self.m)
        if enumeration is None:
            return None
        kept = self._fastest_kept(budgets, error_cap, time_limit, self.kept_bounds, self.settled)
        if kept is None:
            return None
        found = enumeration.fastest(budgets, error_cap, kept)
        if found is kept:  # no choice that offloads is faster
            kept.message = "no choice fits the budget and the caps (every step-time level checked, offload " \
                           "included)" if kept.x is None else "optimal: the fastest step-time level keeping " \
                                                              "every layer, and no offloading choice faster"
        return found


__all__ = ["Levels", "count_priced", "levels"]
