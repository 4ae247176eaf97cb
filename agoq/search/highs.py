"""HiGHS through highspy, its own binding: `milp` (scipy.optimize.milp's arguments and answer, with a first
incumbent where one is known, and without HiGHS's stray output line), `WarmLP` (one LP solved again under new
bounds from its last basis), a small thread pool for independent LPs, and threads for whole searches beside the
caller's (`side_pool`, kept quiet by `quiet_stdout`).
The MILP's modules (agoq.search.milp_model, milp_levels) solve through these."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Optional

import highspy
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult
from scipy.sparse import csr_matrix, vstack


SOLVE_ERROR = 4  # the status of a solve HiGHS ended in error (scipy.optimize.milp's number for it)
# HiGHS's feasibility jump, a primal heuristic run before the root LP of every MILP, found none of the choices the
# search keeps: on the probe profiles' tightest budgets the tie-break's MILP took 0.25 s without it against 0.33 s
# (H100), 0.17 against 0.22 s (H200), a whole offloaded prefix 0.35 against 0.44 s, with the same answers (medians
# of 8 solves, 2-core CPU)
DEFAULT_OPTIONS = {"mip_heuristic_run_feasibility_jump": False}
_STATUS = {  # HiGHS's model status -> scipy.optimize.milp's status: 0 optimal, 1 a limit, 2 infeasible, 3 unbounded
    highspy.HighsModelStatus.kOptimal: 0, highspy.HighsModelStatus.kTimeLimit: 1,
    highspy.HighsModelStatus.kIterationLimit: 1, highspy.HighsModelStatus.kSolutionLimit: 1,
    highspy.HighsModelStatus.kInfeasible: 2, highspy.HighsModelStatus.kModelError: 2,
    highspy.HighsModelStatus.kUnbounded: 3}


class _Solver(highspy._core._Highs):
    """HiGHS's solver object as the C++ library has it, made with its log off. highspy's `Highs` (a subclass of
    this one) turns on Python callbacks when it is made, and highspy 1.16 then writes HiGHS's banner ("Running
    HiGHS 1.16.0 ...") to descriptor 1, once a process, before any option can be set: into a script's output or
    the dashboard server's log. Made so, no line is written (test_highs). The search uses no callback."""

    def __init__(self):
        super().__init__()
        self.setOptionValue("output_flag", False)


def milp(c, *, constraints, integrality=None, bounds=None, options: Optional[dict] = None,
         initial: Optional[np.ndarray] = None) -> OptimizeResult:
    """min c x subject to `constraints` (LinearConstraint, or a list of them), `bounds` (Bounds, or (lb, ub);
    default 0 and +inf) and `integrality` (1 where a variable is integer): scipy.optimize.milp's arguments and
    answer (x, fun, status, success, message, mip_gap, mip_dual_bound, mip_node_count), solved by HiGHS through
    highspy with DEFAULT_OPTIONS under `options` (mip_rel_gap, time_limit, presolve: HiGHS's own names).
    `initial`, a choice known to meet every row and bound, is HiGHS's first incumbent: it prunes from the start.

    Solved again without HiGHS's presolve where it ends in a solve error (status 4): on the shipped H200 probe
    profile the least peak of the compiled QuanGrad problem at 1 x 2 under the recipe's error cap ended so, which
    made the search report that no choice met its caps at any budget; without presolve HiGHS solves it (9.83 GB), as
    it does every other problem.

    HiGHS 1.12 prints "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" to the process's
    file descriptor 1 on some solves, whatever its display option. In the main thread (the CLI, scripts)
    descriptor 1 points at /dev/null for the solve's duration (`quiet_stdout`); other threads (the dashboard's
    solver pool) solve as they are: redirecting a descriptor the whole process shares would swallow the server's
    own output."""
    options = dict(options or {})
    result = _solve(c, constraints, integrality, bounds, options, initial)
    if result.status == SOLVE_ERROR and options.get("presolve", True):
        result = _solve(c, constraints, integrality, bounds, {**options, "presolve": False}, initial)
    return result


def _solve(c, constraints, integrality, bounds, options: dict, initial: Optional[np.ndarray]) -> OptimizeResult:
    c = np.asarray(c, float)
    n = len(c)
    integer = np.zeros(n) if integrality is None else np.broadcast_to(np.asarray(integrality, float), (n,))
    if bounds is None:
        bounds = Bounds(0.0, np.inf)
    elif not isinstance(bounds, Bounds):
        bounds = Bounds(*bounds)
    lp = _highs_lp(c, [constraints] if isinstance(constraints, LinearConstraint) else list(constraints))
    lp.col_lower_ = _finite(np.broadcast_to(np.asarray(bounds.lb, float), (n,)))
    lp.col_upper_ = _finite(np.broadcast_to(np.asarray(bounds.ub, float), (n,)))
    mip = bool(integer.any())
    if mip:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]
    highs = _Solver()
    for key, value in {**DEFAULT_OPTIONS, **options}.items():
        if key == "presolve":
            value = "on" if value else "off"
        if highs.setOptionValue(key, value) != highspy.HighsStatus.kOk:
            raise ValueError(f"HiGHS refused the option {key}={value!r}")
    highs.passModel(lp)
    if initial is not None and mip:
        start = highspy.HighsSolution()
        start.col_value = np.where(integer > 0, np.round(initial), initial)
        start.value_valid = True
        highs.setSolution(start)
    with quiet_stdout():
        highs.run()
    status = highs.getModelStatus()
    info = highs.getInfo()
    code = _STATUS.get(status, SOLVE_ERROR)
    found = code == 0 or (mip and code == 1 and info.objective_function_value < highspy.kHighsInf)
    x = np.asarray(highs.getSolution().col_value, float) if found else None
    result = OptimizeResult(x=x, fun=float(c @ x) if found else None, status=code, success=code == 0,
                            message=highs.modelStatusToString(status))
    if mip:
        result.mip_gap, result.mip_dual_bound = info.mip_gap, info.mip_dual_bound
        result.mip_node_count = info.mip_node_count
    return result


def _highs_lp(c: np.ndarray, constraints: list):
    """HiGHS's LP of min c x over the rows of `constraints` (column bounds and integrality not yet set)."""
    stacked = [LinearConstraint(k.A, k.lb, k.ub) for k in constraints]  # scalar sides broadcast
    a = vstack([csr_matrix(k.A) for k in stacked]).tocsc()  # (LinearConstraint has made each A two-dimensional)
    lo = np.concatenate([np.broadcast_to(np.asarray(k.lb, float), (k.A.shape[0],)) for k in stacked])
    hi = np.concatenate([np.broadcast_to(np.asarray(k.ub, float), (k.A.shape[0],)) for k in stacked])
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(c), a.shape[0]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(c), a.shape[0]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
    lp.col_cost_ = np.asarray(c, float)
    lp.row_lower_, lp.row_upper_ = _finite(lo), _finite(hi)
    return lp


@contextmanager
def quiet_stdout():
    """Descriptor 1 pointed at /dev/null while the block runs, in the main thread only (elsewhere: nothing), for
    HiGHS's stray line (see `milp`) from this thread's solves and from those of the threads working for it
    meanwhile (`side_pool`). Python's own output is flushed before and after: text written to sys.stdout in the
    block but not yet flushed is written after it; what the block flushes itself is lost, so a block holds solves,
    not prints. Blocks nest."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no descriptor 1 to protect (closed, or replaced streams)
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        try:
            sys.stdout.flush()
        except (OSError, ValueError, AttributeError):
            pass


_POOL = None
_POOL_LOCK = threading.Lock()


def lp_pool() -> ThreadPoolExecutor:
    """Threads for independent small LPs (the knob combinations' relaxations, agoq.search.knobs), one per core up
    to two: HiGHS releases the GIL, so two LPs run at once."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():  # a forked child has none of its parent's threads
            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)),
                                                     thread_name_prefix="agoq-lp"))
        return _POOL[1]


_SIDE = None


def side_pool() -> ThreadPoolExecutor:
    """Threads (one per core, up to two: two requests of the plan service at once) for a whole search that runs
    beside its caller's and is not needed until the caller's ends (a plan's alternatives, agoq.search.search; the
    winner's binding constraints while its ties are broken, agoq.search.knobs): HiGHS releases the GIL, so its
    solves fill the core that one MILP of the caller's leaves idle. Their own LPs go to
    `lp_pool`, whose threads never wait on them: no deadlock. The caller holds `quiet_stdout` while they run."""
    global _SIDE
    with _POOL_LOCK:
        if _SIDE is None or _SIDE[0] != os.getpid():
            _SIDE = (os.getpid(), ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)),
                                                     thread_name_prefix="agoq-side"))
        return _SIDE[1]


class WarmLP:
    """One linear program kept in HiGHS (min c x, `constraints`, column bounds) and solved again under new column
    bounds, each solve starting from the last one's basis: after a bound change HiGHS's dual simplex goes on from
    where it stood instead of from a slack basis. The offloaded prefixes' relaxations differ in the bounds of the
    offload variables only: on the H100 probe profile's tightest budget 17 of them took 0.03-0.05 s so, against
    0.18-0.29 s solved each from scratch (one after another, 2-core CPU). Not thread-safe: one per thread."""

    def __init__(self, c: np.ndarray, constraints: list):
        self._lp = _highs_lp(np.asarray(c, float), list(constraints))
        self._highs = None
        self.n = len(c)

    def solve(self, bounds: Bounds) -> OptimizeResult:
        """The relaxation under `bounds`: x and fun where optimal (status 0), x None and status 2 where infeasible,
        x None and status 4 where HiGHS ends otherwise (as scipy.optimize.milp's statuses)."""
        lb, ub = _finite(np.asarray(bounds.lb, float)), _finite(np.asarray(bounds.ub, float))
        if self._highs is None:
            self._highs = highs = _Solver()
            highs.setOptionValue("presolve", "off")  # (a warm start needs none; these small LPs are quicker without)
            self._lp.col_lower_, self._lp.col_upper_ = lb, ub
            highs.passModel(self._lp)
        else:
            self._highs.changeColsBounds(self.n, np.arange(self.n, dtype=np.int32), lb, ub)
        self._highs.run()
        status = self._highs.getModelStatus()
        if status == highspy.HighsModelStatus.kOptimal:
            x = np.asarray(self._highs.getSolution().col_value, float)
            return OptimizeResult(x=x, fun=float(self._lp.col_cost_ @ x), status=0, success=True, message="optimal")
        infeasible = status == highspy.HighsModelStatus.kInfeasible
        return OptimizeResult(x=None, fun=None, status=2 if infeasible else 4, success=False,
                              message=self._highs.modelStatusToString(status))


def _finite(v: np.ndarray) -> np.ndarray:
    """Infinite bounds as HiGHS's own infinity."""
    return np.clip(v, -highspy.kHighsInf, highspy.kHighsInf)


__all__ = ["milp", "lp_pool", "quiet_stdout", "side_pool", "WarmLP"]
