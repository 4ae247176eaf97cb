"""The outer knob search against brute force: every knob combination x every per-layer choice of a one-layer
profile, evaluated by ChoiceProblem.evaluate, the best tokens/s under the budget and the error cap."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from agoq.formats.profile import load_profile
from agoq.models import build
from agoq.runtime.optim.state_bytes import state_table
from agoq.search.costs import build_problem
from agoq.search.knobs import KnobSpace, combinations, solve_knobs, tokens_per_second
from agoq.search.milp import InfeasibleBudget
from agoq.search.milp_model import FIRST_GAP
from tests.search.synthetic_profile import write_profile


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def _profile(tmp_path, rng, paper_delta: float, micro_batch: int = 2):
    """A one-layer profile with 4-bit options only, the fused step's state table, a measured optimizer step and
    an agoq-paper step `paper_delta` seconds per layer away from the bf16 step."""
    folder = write_profile(tmp_path / "p", rng, num_layers=1, bits=(4,), micro_batch=micro_batch, seq_len=37,
                           layer_forward=True, step_seconds=rng.uniform(0.04, 0.06))
    header = json.loads((folder / "profile.json").read_text())
    m = build("llama-tiny", device="meta", num_layers=1)
    header["memory"]["state"] = state_table([p.numel() for p in m.parameters()])
    header["memory"]["measured_with"] = {"optimizer": "adamw8bit", "master": "fp32", "gradients": "bf16"}
    bf16 = header["memory"]["steps"][0]
    bf16["optimizer_step_seconds"] = rng.uniform(0.002, 0.01)
    (folder / "profile.json").write_text(json.dumps(header))
    # every measured agoq-paper step: the bf16 step of its knobs + delta (one layer: dQ = delta)
    rows = header["measured_steps"]["rows"]
    key = ("compile", "micro_batch", "grad_accum", "gradients", "optimizer", "master")
    for row in rows:
        if row["policy"] == "agoq-paper":
            bf16_row = next(r for r in rows if r["policy"] == "bf16" and all(r[k] == row[k] for k in key))
            row["step_seconds"] = bf16_row["step_seconds"] + paper_delta
    (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder)


def _brute(profile, space, budget, error_cap):
    best = None
    for knobs in combinations(profile, space):
        problem = build_problem(profile, knobs)
        groups = [g for _, g in sorted(problem.groups().items())]
        candidates = [(np.array(c, dtype=int), False) for c in itertools.product(*groups)]
        candidates.append((np.array([], dtype=int), True))
        for chosen, ckpt in candidates:
            f = problem.evaluate(chosen, np.array([ckpt]))
            if max(f["peak_bytes_per_stage"]) > budget:
                continue
            if error_cap is not None and f["grad_error"] > error_cap * (1 + 1e-9):
                continue
            tps = tokens_per_second(profile, knobs, f["step_seconds"])
            if best is None or tps > best[0] * (1 + 1e-12):
                best = (tps, knobs, f)
    return best


@pytest.mark.parametrize("paper_delta", [-0.004, 0.003])
def test_knob_search_equals_brute_force(tmp_path, paper_delta):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, paper_delta)
    # the calibration reads back the delta it was given
    assert build_problem(profile).laaq_layer_seconds == pytest.approx(paper_delta, rel=1e-9, abs=1e-12)
    space = KnobSpace(masters=("fp32", "none"))
    peaks = []
    for knobs in combinations(profile, space):
        problem = build_problem(profile, knobs)
        sixteen = np.nonzero(problem.keeps_16bit())[0]
        peaks.append(max(problem.evaluate(sixteen, np.array([False]))["peak_bytes_per_stage"]))
        peaks.append(max(problem.evaluate(np.array([], dtype=int), np.array([True]))["peak_bytes_per_stage"]))
    for _ in range(3):
        budget = int(rng.uniform(min(peaks), max(peaks)))
        cap = rng.choice([None, rng.uniform(0.0, 0.3)])
        expected = _brute(profile, space, budget, cap)
        if expected is None:
            with pytest.raises(InfeasibleBudget):
                solve_knobs(profile, budget, error_cap=cap, space=space)
            continue
        for prune in (True, False):
            found = solve_knobs(profile, budget, error_cap=cap, space=space, prune=prune)
            # within the first objective's MIP gap (FIRST_GAP) of brute force, never above it
            assert expected[0] * (1 - FIRST_GAP) - 1e-9 <= found.best.tokens_per_second <= expected[0] * (1 + 1e-9), \
                (seed, budget, cap, prune)
            assert max(found.best.alloc.peak_bytes_per_stage) <= budget
            assert found.binding and set(found.binding) <= {"memory budget", "error cap", "none"}


def test_bounded_search_equals_solving_every_combination(tmp_path):
    """The search skips a combination whose linear relaxation is already slower than the best exact optimum found;
    that must never change the answer: on a 5-layer profile (micro-batch splits, optimizers, masters, gradient
    storage), at budgets across the feasible range and under error caps, the plan equals the one found by solving
    every combination (prune=False), and below the least budget both give the same smallest feasible budget."""
    seed, rng = fresh_rng()
    folder = write_profile(tmp_path / "p", rng, num_layers=5, micro_batch=4, seq_len=37)
    profile = load_profile(folder)
    space = KnobSpace(masters=("fp32", "none"))
    from agoq.search.knobs import budget_bounds

    least, largest = budget_bounds(profile, space)
    for frac in (0.0, 0.004, 0.03, 0.2, 0.7):
        budget = int(least + frac * (largest - least)) + 3
        cap = rng.choice([None, rng.uniform(0.01, 0.3)])
        try:
            every = solve_knobs(profile, budget, error_cap=cap, space=space, prune=False)
        except InfeasibleBudget as e:
            with pytest.raises(InfeasibleBudget) as bounded:
                solve_knobs(profile, budget, error_cap=cap, space=space)
            assert bounded.value.smallest_budget == e.smallest_budget, (seed, budget, cap)
            continue
        bounded = solve_knobs(profile, budget, error_cap=cap, space=space)
        assert bounded.best.tokens_per_second == pytest.approx(every.best.tokens_per_second, rel=FIRST_GAP), \
            (seed, budget, cap)
        assert bounded.best.alloc.grad_error <= (cap or np.inf) * (1 + 1e-9)
        assert max(bounded.best.alloc.peak_bytes_per_stage) <= budget
        assert len(bounded.tried) == len(every.tried)  # every combination is reported, solved or not
    with pytest.raises(InfeasibleBudget) as low:
        solve_knobs(profile, least - 1, space=space)
    assert low.value.smallest_budget == least, seed


def test_binding_constraint_is_the_budget_when_tight(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, 0.002)  # LAAQ's layer is slower here: all-16 is the fastest plan
    space = KnobSpace(gradient_modes=("bf16",), optimizers=("adamw",), micro_batches=(2,))
    problem = build_problem(profile, combinations(profile, space)[0])
    sixteen = np.nonzero(problem.keeps_16bit())[0]
    roomy = max(problem.evaluate(sixteen, np.array([False]))["peak_bytes_per_stage"])
    assert solve_knobs(profile, roomy * 2, space=space).binding == ["none"]
    tight = solve_knobs(profile, roomy - 1, space=space)
    assert "memory budget" in tight.binding, seed


def test_splits_and_bad_micro_batches(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, 0.0, micro_batch=2)
    splits = {(k.micro_batch, k.grad_accum) for k in combinations(profile, KnobSpace(global_batch=6))}
    assert splits == {(1, 6), (2, 3), (3, 2), (6, 1)}
    with pytest.raises(ValueError, match="do not divide"):
        combinations(profile, KnobSpace(global_batch=6, micro_batches=(4,)))
    with pytest.raises(ValueError, match="compile mode"):
        combinations(profile, KnobSpace(compile_modes=("compiled",)))


def test_optuna_trials_keep_to_the_gradient_storage_asked(tmp_path):
    """`--gradients quangrad8` with --method both: every trial of the study, and so the plan, stores gradients in
    8 bits, on a profile of several ranks that also offers bf16 and sdp4bit."""
    import random

    from agoq.formats.profile import load_profile
    from agoq.search.knobs import KnobSpace as Knobs
    from agoq.search.search import search
    from tests.search.synthetic_profile import write_profile

    profile = load_profile(write_profile(tmp_path / "p", random.Random(7), world_size=2, collectives=True))
    outcome = search(profile, 10**9, method="both", trials=5, front_budgets=0, progress=False,
                     out_dir=tmp_path / "s", space=Knobs(gradient_modes=("quangrad8",)))
    assert outcome.plan.gradients.mode == "quangrad8"
    assert {c.plan.gradients.mode for c in outcome.candidates} == {"quangrad8"}


def _binding_spy(monkeypatch):
    """Record each binding question (its thread, the objective value it was asked of, its answer)."""
    import threading

    from agoq.search import knobs as knobs_module

    asked, real = [], knobs_module.binding_constraints

    def spy(problem, mine, *args):
        answer = real(problem, mine, *args)
        asked.append((threading.current_thread().name, mine, answer))
        return answer

    monkeypatch.setattr(knobs_module, "binding_constraints", spy)
    return asked


def test_binding_asked_beside_the_tie_break_is_the_binding_asked_after_it(tmp_path, monkeypatch):
    """With one winning combination its binding constraints are asked on a side thread while its ties are broken:
    on a 5-layer profile at budgets across the range, under error caps, the answer and the plan equal those of the
    search that asks after the tie-break (knobs.BINDING_BESIDE off), and the side thread did the asking."""
    import types

    from agoq.search import knobs as knobs_module
    from agoq.search.knobs import budget_bounds

    seed, rng = fresh_rng()
    profile = load_profile(write_profile(tmp_path / "p", rng, num_layers=5, micro_batch=4, seq_len=37))
    space = KnobSpace(masters=("fp32", "none"))
    least, largest = budget_bounds(profile, space)
    asked = _binding_spy(monkeypatch)
    beside = 0
    for frac in (0.0, 0.01, 0.05, 0.3, 0.9):
        budget = int(least + frac * (largest - least)) + rng.randrange(1, 1000)
        cap = rng.choice([None, rng.uniform(0.01, 0.3)])
        monkeypatch.setattr(knobs_module, "BINDING_BESIDE", False)
        try:
            after = solve_knobs(profile, budget, error_cap=cap, space=space)
        except InfeasibleBudget:
            continue
        monkeypatch.setattr(knobs_module, "BINDING_BESIDE", True)
        monkeypatch.setattr(knobs_module, "os", types.SimpleNamespace(cpu_count=lambda: 2))
        del asked[:]
        found = solve_knobs(profile, budget, error_cap=cap, space=space)
        assert found.binding == after.binding, (seed, budget, cap)
        assert found.best.knobs == after.best.knobs and found.best.alloc.step_seconds == after.best.alloc.step_seconds
        tied = [r for r in found.tried if r.alloc is not None and r.error is None]
        if len(tied) == 1:
            assert [a[0].startswith("agoq-side") for a in asked] == [True], (seed, asked)
            beside += 1
    assert beside, seed  # some budget had one winner: the side thread was exercised


def test_a_tie_break_that_betters_the_first_objective_asks_the_binding_question_again(tmp_path, monkeypatch):
    """The question asked beside the tie-break is of the first objective's value; where the tie-break returns a
    faster choice (the first solve stops within FIRST_GAP of the optimum) it is asked again of the faster one."""
    from dataclasses import replace as dc_replace

    from agoq.search.milp import Solver

    seed, rng = fresh_rng()
    profile = load_profile(write_profile(tmp_path / "p", rng, num_layers=5, micro_batch=4, seq_len=37))
    space = KnobSpace(gradient_modes=("bf16",), optimizers=("adamw",), masters=("fp32",), micro_batches=(4,))
    asked = _binding_spy(monkeypatch)
    real_solve = Solver.solve
    factor = rng.uniform(0.9, 0.99)

    def faster_tie_break(self, *args, **kwargs):  # the tie-break's choice, reported faster than the first's
        alloc = real_solve(self, *args, **kwargs)
        return dc_replace(alloc, step_seconds=alloc.step_seconds * factor) if self.tie_break else alloc

    monkeypatch.setattr(Solver, "solve", faster_tie_break)
    import types

    from agoq.search import knobs as knobs_module
    from agoq.search.knobs import budget_bounds

    monkeypatch.setattr(knobs_module, "os", types.SimpleNamespace(cpu_count=lambda: 2))  # a core for the side thread

    least, largest = budget_bounds(profile, space)
    found = solve_knobs(profile, int(least + rng.uniform(0.05, 0.5) * (largest - least)), space=space)
    assert [a[0].startswith("agoq-side") for a in asked] == [True, False], (seed, asked)
    assert asked[1][1] == pytest.approx(asked[0][1] * factor, rel=1e-12)
    assert asked[1][1] == found.best.alloc.step_seconds
    assert found.binding == asked[1][2]
