"""The MILP solver's stray standard-output line (HiGHS's) never reaches the user's terminal from the
main thread, while agoq's own output does."""

import os
import threading

import numpy as np
from scipy.optimize import LinearConstraint

from agoq.search import highs


def _noisy(self):
    os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")  # as HiGHS does
    return _noisy.real(self)


def _small_problem(rng):
    n = int(rng.integers(5, 13))
    c = rng.uniform(0.1, 1.0, n)
    weights = rng.uniform(1.0, 3.0, n)
    cons = LinearConstraint(weights[None, :], float(weights.sum() * 0.3), np.inf)
    return c, cons, weights


def test_solver_lines_on_stdout_are_dropped_in_the_main_thread(capfd, monkeypatch, seed):
    rng = np.random.default_rng(seed)
    _noisy.real = highs._Solver.run
    monkeypatch.setattr(highs._Solver, "run", _noisy)
    c, cons, weights = _small_problem(rng)
    print("before the solve", flush=True)
    res = highs.milp(c, constraints=[cons], integrality=np.ones(len(c)), bounds=(0, 1))
    print("after the solve", flush=True)
    out = capfd.readouterr().out
    assert "tmpSolver" not in out
    assert "before the solve" in out and "after the solve" in out
    # the answer is HiGHS's: a cover of >= 30 % of the weight at least cost, checked by brute force
    best = min(float(c @ x) for x in (np.array([(k >> i) & 1 for i in range(len(c))]) for k in range(2 ** len(c)))
               if float(weights @ x) >= weights.sum() * 0.3)
    assert res.status == 0 and abs(res.fun - best) <= 1e-9 * max(1.0, abs(best))


def test_other_threads_leave_stdout_alone(capfd, monkeypatch, seed):
    """A worker thread (the dashboard's solver pool) must not redirect the descriptor the server writes to."""
    rng = np.random.default_rng(seed)
    _noisy.real = highs._Solver.run
    monkeypatch.setattr(highs._Solver, "run", _noisy)
    c, cons, _ = _small_problem(rng)
    done = []
    t = threading.Thread(target=lambda: done.append(highs.milp(c, constraints=[cons],
                                                                     integrality=np.ones(len(c)), bounds=(0, 1))))
    t.start()
    t.join()
    assert done and done[0].status == 0
    assert "tmpSolver" in capfd.readouterr().out  # untouched: the line went where the process's stdout goes


def test_a_side_threads_solves_are_quiet_while_the_main_thread_holds_quiet_stdout(capfd, monkeypatch, seed):
    """The search prices its alternatives on highs.side_pool while it searches (agoq.search.search): inside the
    main thread's quiet_stdout block, a solve on the side thread drops HiGHS's line too, blocks nest, and agoq's
    own output before and after the block (and text left unflushed in it) still reaches stdout."""
    rng = np.random.default_rng(seed)
    _noisy.real = highs._Solver.run
    monkeypatch.setattr(highs._Solver, "run", _noisy)
    c, cons, _ = _small_problem(rng)
    print("before the block", flush=True)
    with highs.quiet_stdout():
        side = highs.side_pool().submit(highs.milp, c, constraints=[cons], integrality=np.ones(len(c)),
                                        bounds=(0, 1))
        with highs.quiet_stdout():
            mine = highs.milp(c, constraints=[cons], integrality=np.ones(len(c)), bounds=(0, 1))
        theirs = side.result(timeout=60)
        print("written in the block", end="")
    print(" and after it", flush=True)
    out = capfd.readouterr().out
    assert "tmpSolver" not in out, out
    assert "before the block" in out and "written in the block and after it" in out, out
    assert mine.status == theirs.status == 0 and abs(mine.fun - theirs.fun) <= 1e-12 * max(1.0, abs(mine.fun))
