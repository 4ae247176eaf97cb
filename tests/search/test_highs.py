"""HiGHS through agoq.search.highs: a solve that ends in HiGHS's solve error (status 4) is solved again without
presolve; the shipped H200 probe profile's problem that ended so has its least peak, the budget at which the MILP
first fits."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult

from agoq.examples import profiles
from agoq.formats.profile import load_profile
from agoq.search import highs
from agoq.search.costs import ProblemSettings, build_problem
from agoq.search.milp import InfeasibleBudget, Solver, resolve_error_cap


def test_a_solve_error_is_solved_again_without_presolve(monkeypatch):
    rng = random.Random()
    n = rng.randint(3, 9)
    c = np.array([rng.uniform(-2, -0.1) for _ in range(n)])
    weights = np.array([rng.uniform(0.5, 3) for _ in range(n)])
    cap = float(weights.sum()) * rng.uniform(0.3, 0.7)
    calls = []

    def flaky(c, constraints, integrality, bounds, options, initial):  # failing with presolve on, as on the probe
        calls.append(dict(options))
        if options.get("presolve", True):
            return OptimizeResult(x=None, status=highs.SOLVE_ERROR, message="HiGHS Status 4: Solve error")
        return flaky.real(c, constraints, integrality, bounds, options, initial)

    flaky.real = highs._solve
    monkeypatch.setattr(highs, "_solve", flaky)
    res = highs.milp(c, constraints=[LinearConstraint(weights[None, :], -np.inf, cap)], integrality=np.ones(n),
                     bounds=Bounds(0, 1), options={"mip_rel_gap": 1e-9})
    assert res.status == 0 and [o.get("presolve", True) for o in calls] == [True, False]
    best = min(float(c @ np.array(x)) for x in np.ndindex(*(2,) * n) if weights @ np.array(x) <= cap)  # brute force
    assert float(c @ res.x) == pytest.approx(best, abs=1e-9)


def test_the_probes_least_peak_under_the_recipe_cap_is_where_the_milp_first_fits():
    profile = load_profile(profiles()["probe-h200"])
    knobs = ProblemSettings(compile_mode="compiled", micro_batch=1, grad_accum=2, gradient_mode="quangrad8",
                            optimizer="adamw8bit", master="fp32", quantize_attention=False)
    problem = build_problem(profile, knobs)
    solver = Solver(problem)
    cap = resolve_error_cap(problem, "recipe")
    least = solver.smallest_budget(None, cap)
    assert least is not None
    assert max(solver.solve(least, "time", error_cap=cap).peak_bytes_per_stage) <= least
    with pytest.raises(InfeasibleBudget):
        solver.solve(int(least * 0.999), "time", error_cap=cap)


def _vertex_optimum(c, a, lo, hi, lb, ub):
    """min c x over {lo <= a x <= hi, lb <= x <= ub} by brute force: every vertex (n of the constraints active, a
    bounded polytope has its optimum at one), None when no vertex is feasible (then the polytope is empty)."""
    n = len(c)
    g, h = [], []
    for row, low, high in zip(a, lo, hi):
        if np.isfinite(high):
            g.append(row), h.append(high)
        if np.isfinite(low):
            g.append(-row), h.append(-low)
    for j in range(n):
        e = np.eye(n)[j]
        g += [e, -e]
        h += [ub[j], -lb[j]]
    g, h = np.array(g), np.array(h)
    best = None
    for active in itertools.combinations(range(len(g)), n):
        sub = g[list(active)]
        if abs(np.linalg.det(sub)) < 1e-9:
            continue
        x = np.linalg.solve(sub, h[list(active)])
        if (g @ x <= h + 1e-9).all() and (best is None or c @ x < best):
            best = float(c @ x)
    return best


def test_a_warm_lp_solved_again_under_new_bounds_has_each_one_s_optimum():
    """WarmLP's answers, each solve starting from the last one's basis, against brute force over the vertices:
    the same optimum where the bounds leave a choice, "infeasible" where they leave none."""
    rng = np.random.default_rng(random.randrange(2**32))
    n, m = int(rng.integers(4, 6)), int(rng.integers(2, 4))
    a = np.round(rng.uniform(-2, 3, (m, n)) * (rng.random((m, n)) < 0.8), 3)
    c = np.round(rng.uniform(-1, 2, n), 3)
    lo = np.where(rng.random(m) < 0.5, -np.inf, rng.uniform(-1.5, 0.5, m))
    hi = np.where(np.isinf(lo), rng.uniform(0.3, 2.5, m), lo + rng.uniform(0, 2, m))
    hi[0] = lo[0] = rng.uniform(0.2, 1.0) if rng.random() < 0.5 else hi[0]  # sometimes an equality row, as the MILP's
    lp = highs.WarmLP(c, [LinearConstraint(a[:1], lo[:1], hi[:1]), LinearConstraint(a[1:], lo[1:], hi[1:])])
    seen = {0: 0, 2: 0}
    for i in range(23):
        lb = rng.uniform(-1.3, 0.4, n) if i % 2 else rng.uniform(-3, -1.5, n)  # narrow boxes, and wide ones
        ub = lb + (rng.uniform(0, 1.7, n) if i % 2 else rng.uniform(3, 4.5, n))
        fixed = rng.random(n) < 0.3  # some variables fixed, as the offloaded prefixes' are
        ub[fixed] = lb[fixed]
        res = lp.solve(Bounds(lb, ub))
        best = _vertex_optimum(c, a, lo, hi, lb, ub)
        assert res.status == (2 if best is None else 0), (res.status, best)
        seen[res.status] += 1
        if best is not None:
            assert float(c @ res.x) == pytest.approx(best, abs=1e-7) and res.fun == pytest.approx(best, abs=1e-7)
            assert (res.x >= lb - 1e-7).all() and (res.x <= ub + 1e-7).all()
            assert (a @ res.x <= hi + 1e-7).all() and (a @ res.x >= lo - 1e-7).all()
    assert seen[0] and seen[2]  # both answers were asked for, at least once each


def test_a_first_incumbent_is_where_the_solve_starts_and_the_optimum_is_still_found():
    """`initial`: a choice meeting every row is HiGHS's incumbent from the start (a solve stopped at once still has
    it, where without it there is no choice), and a solve let run ends at brute force's optimum from it."""
    rng = np.random.default_rng(random.randrange(2**32))
    n = int(rng.integers(7, 12))
    c = rng.uniform(0.1, 1.0, n)
    weights = rng.uniform(1.0, 3.0, n)
    cover = LinearConstraint(weights[None, :], float(weights.sum() * rng.uniform(0.2, 0.6)), np.inf)
    start = (rng.random(n) < 0.8).astype(float)
    start[np.argsort(-weights)[:int(np.ceil(n * 0.6))]] = 1.0  # the heaviest 60 %: meets the cover
    assert weights @ start >= cover.lb[0]
    stopped = [highs.milp(c, constraints=[cover], integrality=np.ones(n), bounds=(0, 1),
                          options={"time_limit": 1e-9}, initial=given) for given in (None, start)]
    assert stopped[0].x is None and stopped[1].status == 1 and float(c @ stopped[1].x) <= float(c @ start) + 1e-12
    res = highs.milp(c, constraints=[cover], integrality=np.ones(n), bounds=(0, 1), options={"mip_rel_gap": 0.0},
                     initial=start)
    best = min(float(c @ x) for x in map(np.array, itertools.product((0.0, 1.0), repeat=n))
               if weights @ x >= cover.lb[0])
    assert res.status == 0 and res.fun == pytest.approx(best, abs=1e-9)


def test_a_fresh_process_solving_writes_nothing_to_stdout():
    """HiGHS's banner ("Running HiGHS ...") is written once a process, when highspy's first solver object is made:
    a process that solves a MILP and a warm LP through agoq.search.highs outside any quiet_stdout block (a script,
    a server thread) prints nothing but its own answer, and the answers are brute force's."""
    import subprocess
    import sys

    rng = random.Random()
    n = rng.randint(3, 9)
    c = [round(rng.uniform(-2, -0.1), 6) for _ in range(n)]
    w = [round(rng.uniform(0.5, 3), 6) for _ in range(n)]
    cap = round(sum(w) * rng.uniform(0.3, 0.7), 6)
    script = (
        "import numpy as np\n"
        "from scipy.optimize import Bounds, LinearConstraint\n"
        "from agoq.search import highs\n"
        f"c, w, cap = np.array({c}), np.array({w}), {cap}\n"
        "rows = [LinearConstraint(w[None, :], -np.inf, cap)]\n"
        "a = highs.milp(c, constraints=rows, integrality=np.ones(len(c)), bounds=Bounds(0, 1))\n"
        "b = highs.WarmLP(c, rows).solve(Bounds(np.zeros(len(c)), np.ones(len(c))))\n"
        "print(repr((a.fun, b.fun)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.count("\n") == 1, out  # the answer's line alone
    mip, lp = eval(out)
    best = min(float(np.dot(c, x)) for x in np.ndindex(*(2,) * n) if np.dot(w, x) <= cap)
    assert mip == pytest.approx(best, abs=1e-9)
    # the relaxation (fractional knapsack): greedy by value per weight, brute force's bound from below
    order = sorted(range(n), key=lambda i: c[i] / w[i])
    room, relaxed = cap, 0.0
    for i in order:
        take = min(1.0, room / w[i])
        relaxed, room = relaxed + take * c[i], room - take * w[i]
    assert lp == pytest.approx(relaxed, abs=1e-9) and lp <= best + 1e-12
