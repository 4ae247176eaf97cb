"""HiGHS through scipy: `milp` (scipy.optimize.milp without HiGHS's stray output line), a small thread pool for
independent LPs, and threads for whole searches beside the caller's (`side_pool`, kept quiet by `quiet_stdout`);
and through highspy, HiGHS's own binding: `WarmLP`, one LP solved again under new bounds from its last basis.
The MILP's modules (agoq.search.milp_model, milp_levels) solve through these."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import highspy
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult
from scipy.optimize import milp as _scipy_milp
from scipy.sparse import csr_matrix, vstack


SOLVE_ERROR = 4  # scipy.optimize.milp's status for "HiGHS Status 4: Solve error"


def milp(c, **kwargs):
    """scipy.optimize.milp, without HiGHS's stray standard-output line, and solved again without HiGHS's presolve
    where it ends in a solve error (status 4): on the shipped H200 probe profile the least peak of the compiled
    QuanGrad problem at 1 x 2 under the recipe's error cap ended so, which made the search report that no choice
    met its caps at any budget; without presolve HiGHS solves it (9.83 GB), as it does every other problem.

    HiGHS 1.12 (inside scipy) prints "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();"
    to the process's file descriptor 1 on some solves, whatever its display option. In the main thread (the CLI,
    scripts) descriptor 1 points at /dev/null for the solve's duration; Python's own output is flushed first and
    is untouched after. Other threads (the dashboard's solver pool) solve as they are: redirecting a descriptor
    the whole process shares would swallow the server's own output."""
    result = _quiet_milp(c, **kwargs)
    if result.status == SOLVE_ERROR and (kwargs.get("options") or {}).get("presolve", True):
        result = _quiet_milp(c, **{**kwargs, "options": {**(kwargs.get("options") or {}), "presolve": False}})
    return result


def _quiet_milp(c, **kwargs):
    """scipy.optimize.milp with descriptor 1 pointed at /dev/null in the main thread (see `milp`)."""
    with quiet_stdout():
        return _scipy_milp(c, **kwargs)


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
    """Threads for independent small LPs (the prefixes' relaxations), one per core up to two: HiGHS releases the
    GIL, so two LPs run at once (the H100 probe's smallest budget: 34 of them, 0.17 s one after another)."""
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
        stacked = [LinearConstraint(k.A, k.lb, k.ub) for k in constraints]  # scalar sides broadcast
        a = vstack([csr_matrix(k.A) for k in stacked]).tocsc()
        lo = np.concatenate([np.broadcast_to(np.asarray(k.lb, float), (k.A.shape[0],)) for k in stacked])
        hi = np.concatenate([np.broadcast_to(np.asarray(k.ub, float), (k.A.shape[0],)) for k in stacked])
        self._lp = lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(c), a.shape[0]
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(c), a.shape[0]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
        lp.col_cost_ = np.asarray(c, float)
        lp.row_lower_, lp.row_upper_ = _finite(lo), _finite(hi)
        self._highs = None
        self.n = len(c)

    def solve(self, bounds: Bounds) -> OptimizeResult:
        """The relaxation under `bounds`: x and fun where optimal (status 0), x None and status 2 where infeasible,
        x None and status 4 where HiGHS ends otherwise (as scipy.optimize.milp's statuses)."""
        lb, ub = _finite(np.asarray(bounds.lb, float)), _finite(np.asarray(bounds.ub, float))
        if self._highs is None:
            self._highs = highs = highspy.Highs()
            highs.setOptionValue("output_flag", False)
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
