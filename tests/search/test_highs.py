"""HiGHS through agoq.search.highs: a solve that ends in HiGHS's solve error (status 4) is solved again without
presolve; the shipped H200 probe profile's problem that ended so has its least peak, the budget at which the MILP
first fits."""

from __future__ import annotations

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

    def flaky(c, **kwargs):  # HiGHS failing with presolve on, as it did on the probe's least peak
        calls.append(dict(kwargs.get("options") or {}))
        if (kwargs.get("options") or {}).get("presolve", True):
            return OptimizeResult(x=None, status=highs.SOLVE_ERROR, message="HiGHS Status 4: Solve error")
        return flaky.real(c, **kwargs)

    flaky.real = highs._scipy_milp
    monkeypatch.setattr(highs, "_scipy_milp", flaky)
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
