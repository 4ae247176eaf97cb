"""The MILP against brute force on small random instances: same optimum, feasible, and the smallest
feasible budget it reports is the true one."""

import itertools
import random

import numpy as np
import pytest

from agoq.runtime.activations.policy import KINDS, RECOMPUTABLE
from agoq.search.costs import ChoiceProblem
from agoq.search.milp import InfeasibleBudget, Solver
from agoq.search.milp_model import FIRST_GAP
from agoq.search.problem import checkpointing_only


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def random_problem(rng, layers, kinds_per_layer, stages=1):
    """A problem with random costs; kinds include attention and o_proj_input so the shared-input credit and
    the unmodified-layer surcharge are exercised, or (half the time) recomputable kinds with their sources, so that
    a recompute from a quantized source adds its pair's error (ChoiceProblem.pair_options)."""
    kinds = rng.choice([["attention", "o_proj_input", "qkv_input", "silu_input"],
                        ["norm_input", "qkv_input", "silu_input", "ffn2_input"]])[:kinds_per_layer]
    layer, kind, option, memory, seconds, error = [], [], [], [], [], []
    for l in range(layers):
        for k in kinds:
            opts = ["16"] + rng.sample(["8", "5", "4", "3", "2"], rng.randint(1, 2))
            if k in RECOMPUTABLE and rng.random() < 0.7:
                opts.append("recompute")
            big = rng.uniform(50, 150)
            for o in opts:
                layer.append(l)
                kind.append(KINDS.index(k))
                option.append(o)
                if o == "16":
                    memory.append(big), seconds.append(0.0), error.append(0.0)
                elif o == "recompute":
                    memory.append(0.0), seconds.append(rng.uniform(0.5, 2.0)), error.append(0.0)
                else:
                    b = int(o)
                    memory.append(big * b / 16 + rng.uniform(0, 3))
                    seconds.append(rng.uniform(0.05, 0.3))
                    error.append(rng.uniform(0.01, 0.1) * 2.0 ** (4 - b))
    pairs = random_pairs(rng, layer, kind, option)
    stage_of = np.array(sorted(rng.randrange(stages) for _ in range(layers)))
    stage_of[:stages] = np.arange(stages) if layers >= stages else stage_of[:stages]
    stage_of = np.sort(stage_of)
    memory = np.round(memory)  # bytes are whole numbers
    return ChoiceProblem(
        np.array(layer), np.array(kind), option, np.array(memory, float), np.array(seconds, float),
        np.array(error, float), stage_of, np.array([rng.randint(10, 40) for _ in range(layers)], float),
        np.array([rng.uniform(1, 4) for _ in range(layers)]), rng.random() < 0.8,
        np.array([rng.randint(0, 30) for _ in range(layers)], float), np.array([rng.randint(0, 20) for _ in range(layers)], float),
        np.array([rng.randint(100, 200) for _ in range(stages)], float), 1.0,
        floor_bytes=np.array([rng.randint(150, 450) for _ in range(stages)], float) if rng.random() < 0.5 else None,
        in_flight=np.array([rng.randint(1, 3) for _ in range(stages)], float),
        recompute_bytes=np.array([rng.randint(100, 400) for _ in range(layers)], float),
        laaq_transient_bytes=np.array([rng.randint(10, 120) for _ in range(stages)], float) if rng.random() < 0.6
        else None, **pairs)


def random_pairs(rng, layer, kind, option) -> dict:
    """Pairs of options (ChoiceProblem.pair_options, pair_error): each recompute option with each quantized option of
    its source kind in its layer, the error a rebuild from the source at b bits adds about 0.01-0.1 x 2^(4 - b) (as
    a sensitivity at b bits), or none (a pair of 0 is left out) a fifth of the time."""
    pairs, terms = [], []
    for r, o in enumerate(option):
        if o != "recompute":
            continue
        source = KINDS.index(RECOMPUTABLE[KINDS[kind[r]]])
        for b, ob in enumerate(option):
            if layer[b] == layer[r] and kind[b] == source and ob not in ("16", "recompute") and rng.random() < 0.8:
                pairs.append((r, b))
                terms.append(rng.uniform(0.01, 0.1) * 2.0 ** (4 - int(ob)))
    return {"pair_options": np.array(pairs, dtype=int).reshape(-1, 2), "pair_error": np.array(terms, float)}


def brute_force(p: ChoiceProblem):
    """Every choice, evaluated with the cost model's own `evaluate` (the reference for the MILP's matrices)."""
    groups = p.groups()
    per_layer = []
    for l in range(p.num_layers):
        mine = [idx for (gl, _), idx in sorted(groups.items()) if gl == l]
        choices = [(tuple(c), False) for c in itertools.product(*mine)]
        if p.allow_checkpoint:
            choices.append(((), True))
        per_layer.append(choices)
    out = []
    for combo in itertools.product(*per_layer):
        chosen = np.array([i for c, _ in combo for i in c], dtype=int)
        ckpt = np.array([k for _, k in combo])
        f = p.evaluate(chosen, ckpt)
        out.append((max(np.array(f["peak_bytes_per_stage"]) - 0), f))
    return out


@pytest.mark.parametrize("objective", ["error", "time"])
@pytest.mark.parametrize("stages", [1, 2])
def test_same_optimum_as_brute_force(objective, stages):
    seed, rng = fresh_rng()
    for trial in range(4):
        p = random_problem(rng, layers=3, kinds_per_layer=rng.choice([2, 3]), stages=stages)
        everything = brute_force(p)
        solver = Solver(p)
        peaks = sorted({tuple(f["peak_bytes_per_stage"]) for _, f in everything})
        low = min(max(pk) for pk in peaks)
        high = max(max(pk) for pk in peaks)
        for budget in (low, rng.uniform(low, high), rng.uniform(low, high), high):
            cap = None
            if rng.random() < 0.5:
                times = [f["step_seconds"] for _, f in everything]
                cap = rng.uniform(min(times), max(times))
            ecap = None
            if rng.random() < 0.4:
                errors = [f["grad_error"] for _, f in everything]
                ecap = rng.uniform(min(errors), max(errors))
            key = "grad_error" if objective == "error" else "step_seconds"
            fits = [f for _, f in everything if max(f["peak_bytes_per_stage"]) <= budget
                    and (cap is None or f["step_seconds"] <= cap + 1e-9)
                    and (ecap is None or f["grad_error"] <= ecap + 1e-12)]
            if not fits:
                with pytest.raises(InfeasibleBudget):
                    solver.solve(budget, objective, cap, error_cap=ecap)
                continue
            best = min(f[key] for f in fits)
            alloc = solver.solve(budget, objective, cap, error_cap=ecap)
            got = alloc.grad_error if objective == "error" else alloc.step_seconds
            # the first objective within its MIP gap (FIRST_GAP), never better than the optimum
            assert best - 1e-9 <= got <= best + FIRST_GAP * abs(best) + 1e-9, f"seed {seed} trial {trial} budget {budget}"
            assert max(alloc.peak_bytes_per_stage) <= budget + 1, f"seed {seed}"
            other = "step_seconds" if key == "grad_error" else "grad_error"
            best_other = min(f[other] for f in fits if f[key] <= got * (1 + 1e-9) + 1e-15)  # ties with its own
            assert alloc.second_gap == 0.0  # small instances: the second objective is proven optimal too
            got_other = alloc.step_seconds if other == "step_seconds" else alloc.grad_error
            assert got_other == pytest.approx(best_other, rel=1e-6, abs=1e-9), f"seed {seed}: second objective"
            if cap is not None:
                assert alloc.step_seconds <= cap + 1e-6, f"seed {seed}"
            if ecap is not None:
                assert alloc.grad_error <= ecap * (1 + 1e-7), f"seed {seed}"


def test_smallest_budget_is_the_true_minimum():
    seed, rng = fresh_rng()
    for trial in range(5):
        p = random_problem(rng, layers=3, kinds_per_layer=2, stages=rng.choice([1, 2]))
        everything = brute_force(p)
        true_min = min(max(f["peak_bytes_per_stage"]) for _, f in everything)
        solver = Solver(p)
        smallest = solver.smallest_budget()
        assert smallest == pytest.approx(true_min, abs=1), f"seed {seed}"
        solver.solve(smallest + 1)  # feasible
        with pytest.raises(InfeasibleBudget) as e:
            solver.solve(true_min * 0.9)
        assert e.value.smallest_budget == smallest
        assert "smallest feasible budget" in str(e.value) and str(smallest) in str(e.value)


def test_time_cap_that_nothing_meets():
    seed, rng = fresh_rng()
    p = random_problem(rng, layers=2, kinds_per_layer=2)
    fastest = min(f["step_seconds"] for _, f in brute_force(p))
    with pytest.raises(InfeasibleBudget, match="time cap"):
        Solver(p).solve(1e12, "error", time_cap=fastest * 0.5)
    Solver(p).solve(1e12, "error", time_cap=fastest + 1e-9)


def test_a_time_limited_first_solve_keeps_a_feasible_choice_and_reports_its_gap(monkeypatch):
    """With a time limit too short to prove anything, the answer still fits the budget and the caps, and
    Allocation.gap says how far from proven it is (0 when proven)."""
    from types import SimpleNamespace

    import agoq.search.milp as milp_module

    assert milp_module.primary_gap(SimpleNamespace(status=0, mip_gap=0.3)) == 0.0
    assert milp_module.primary_gap(SimpleNamespace(status=1, mip_gap=0.25)) == 0.25
    assert milp_module.primary_gap(SimpleNamespace(status=1, mip_gap=None)) == 1.0
    seed, rng = fresh_rng()
    problem = random_problem(rng, 23, 5)
    proven = Solver(problem)
    budget = proven.smallest_budget() * 1.15
    fast, least = proven.solve(budget, "time"), proven.solve(budget, "error")
    cap = least.grad_error + 0.5 * (fast.grad_error - least.grad_error) + 1e-12  # binds, and some choice meets it
    best = proven.solve(budget, "time", error_cap=cap, time_limit=60.0)
    monkeypatch.setattr(milp_module, "PRIMARY_SECONDS", 1e-3)
    rushed = Solver(problem).solve(budget, "time", error_cap=cap)
    assert max(rushed.peak_bytes_per_stage) <= budget and rushed.grad_error <= cap * (1 + 1e-9), seed
    assert 0.0 <= rushed.gap <= 1.0 and rushed.step_seconds >= best.step_seconds * (1 - 1e-9), seed
    if rushed.step_seconds > best.step_seconds * (1 + 1e-6):
        assert rushed.gap > 0.0, seed  # a worse answer is never reported as proven


def _one_setting_per_stage(p: ChoiceProblem, f_chosen, ckpt) -> bool:
    """Brute force's reference of the constraint: per stage, the layers under LAAQ (neither all 16 nor
    checkpointed) share one setting of every kind."""
    by_stage: dict = {}
    for l in range(p.num_layers):
        mine = {int(p.kind[i]): p.option[i] for i in f_chosen if p.layer[i] == l}
        if ckpt[l] or all(o == "16" for o in mine.values()):
            continue
        by_stage.setdefault(int(p.layer_stage[l]), set()).add(tuple(sorted(mine.items())))
    return all(len(settings) == 1 for settings in by_stage.values())


def one_setting_combos(p: ChoiceProblem):
    """Brute force: (chosen option indices, checkpointed layers) of every choice that keeps one setting per stage."""
    groups = p.groups()
    per_layer = []
    for l in range(p.num_layers):
        mine = [idx for (gl, _), idx in sorted(groups.items()) if gl == l]
        per_layer.append([(tuple(c), False) for c in itertools.product(*mine)]
                         + ([((), True)] if p.allow_checkpoint else []))
    for combo in itertools.product(*per_layer):
        chosen = np.array([i for c, _ in combo for i in c], dtype=int)
        ckpt = np.array([k for _, k in combo])
        if _one_setting_per_stage(p, chosen, ckpt):
            yield chosen, ckpt


def _one_setting_choices(p: ChoiceProblem) -> list[dict]:
    """Brute force: the figures (ChoiceProblem.evaluate) of every choice that keeps one setting per stage."""
    return [p.evaluate(chosen, ckpt) for chosen, ckpt in one_setting_combos(p)]


@pytest.mark.parametrize("stages", [1, 2])
def test_one_setting_per_stage_equals_brute_force(stages):
    """Compiled plans: the MILP under one LAAQ setting per stage finds brute force's optimum over the choices that
    keep to it, and its answer keeps to it."""
    seed, rng = fresh_rng()
    for trial in range(4):
        p = random_problem(rng, layers=3, kinds_per_layer=rng.choice([2, 3]), stages=stages)
        p.laaq_layer_seconds = rng.uniform(-0.2, 0.5)
        p.one_setting_per_stage = True
        everything = []
        for _, f in brute_force(p):
            everything.append(f)
        allowed = _one_setting_choices(p)
        low = min(max(f["peak_bytes_per_stage"]) for f in allowed)
        high = max(max(f["peak_bytes_per_stage"]) for f in allowed)
        solver = Solver(p)
        for budget in (low, rng.uniform(low, high), high):
            fits = [f for f in allowed if max(f["peak_bytes_per_stage"]) <= budget]
            best = min(f["step_seconds"] for f in fits)
            alloc = solver.solve(budget, "time")
            assert best - 1e-9 <= alloc.step_seconds <= best * (1 + FIRST_GAP) + 1e-9, f"seed {seed} trial {trial}"
            assert _one_setting_per_stage(p, alloc.chosen, alloc.checkpoint), f"seed {seed} trial {trial}"


def test_ties_keep_tensors_as_they_are():
    """Where time and error tie, the answer changes the fewest tensors: recompute (error 0) and quantized options
    that cost no time are not chosen at a budget where keeping everything fits."""
    seed, rng = fresh_rng()
    for trial in range(5):
        p = random_problem(rng, layers=3, kinds_per_layer=3)
        p.seconds[:] = 0.0  # every option free in time (compiled layers), checkpointing too
        p.checkpoint_seconds[:] = 0.0
        p.error[np.array([o == "recompute" for o in p.option])] = 0.0
        sixteen = np.nonzero(p.keeps_16bit())[0]
        keep = max(p.evaluate(sixteen, np.zeros(p.num_layers, dtype=bool))["peak_bytes_per_stage"])
        alloc = Solver(p).solve(keep + rng.randint(0, 50), "time")
        assert all(p.option[i] == "16" for i in alloc.chosen) and not alloc.checkpoint.any(), \
            f"seed {seed} trial {trial}: {[p.option[i] for i in alloc.chosen]}"


@pytest.mark.parametrize("one_setting", [True, False])
def test_count_priced_levels_equal_brute_force(one_setting):
    """Compiled pricing (every option 0 s, checkpointing the same seconds in every layer, one stage): the step time
    is a count of unmodified and checkpointed layers, and the fastest choice is found by visiting those counts
    fastest first (agoq.search.milp_levels). Same optimum as brute force, under memory and error caps, with its
    ties broken by the least error; the relaxed bound is never above the optimum."""
    seed, rng = fresh_rng()
    for trial in range(4):
        p = random_problem(rng, layers=3, kinds_per_layer=rng.choice([2, 3]))
        p.seconds[:] = 0.0
        p.checkpoint_seconds[:] = rng.uniform(0.5, 3.0)
        p.laaq_layer_seconds = rng.choice([rng.uniform(-0.2, -0.01), rng.uniform(0.01, 0.5)])
        p.one_setting_per_stage = one_setting
        solver = Solver(p)
        assert solver._model.levels is not None, "the problem is count-priced: its levels are used"
        allowed = []
        for _, f in brute_force(p):
            allowed.append(f)
        if one_setting:
            allowed = _one_setting_choices(p)
        low = min(max(f["peak_bytes_per_stage"]) for f in allowed)
        high = max(max(f["peak_bytes_per_stage"]) for f in allowed)
        errors = [f["grad_error"] for f in allowed]
        for budget in (low, rng.uniform(low, high), rng.uniform(low, high), high):
            ecap = rng.uniform(min(errors), max(errors)) if rng.random() < 0.5 else None
            fits = [f for f in allowed if max(f["peak_bytes_per_stage"]) <= budget
                    and (ecap is None or f["grad_error"] <= ecap + 1e-12)]
            if not fits:
                with pytest.raises(InfeasibleBudget):
                    solver.solve(budget, "time", error_cap=ecap)
                continue
            best = min(f["step_seconds"] for f in fits)
            least_error = min(f["grad_error"] for f in fits if f["step_seconds"] <= best + 1e-9 * abs(best) + 1e-12)
            bound = solver.relaxed_bound(budget, "time", None, ecap)
            assert bound is not None and bound <= best + 1e-9, f"seed {seed} trial {trial}: bound {bound} > {best}"
            alloc = solver.solve(budget, "time", error_cap=ecap)
            where = f"seed {seed} trial {trial} budget {budget} cap {ecap}"
            assert alloc.step_seconds == pytest.approx(best, rel=1e-9, abs=1e-12), where
            assert alloc.grad_error == pytest.approx(least_error, rel=1e-6, abs=1e-9), where
            assert alloc.gap == 0.0 and max(alloc.peak_bytes_per_stage) <= budget, where


def test_a_budget_between_a_choices_exact_and_whole_bytes():
    """A choice's peak is reported in whole bytes rounded up: at a budget a little above the exact bytes of the best
    choice (here: every tensor at 16 bits, no error) but below their whole bytes, that choice is over, and the next
    best (8 bits, d = 1.1-1.5 bytes less) fits. The solver must find it, not a worse one (4 bits): solving against the
    budget itself, then asking again below the reported peak, lost it."""
    seed, rng = fresh_rng()
    for trial in range(5):
        big, f, d = float(rng.randint(200, 900)), rng.uniform(0.05, 0.3), rng.uniform(1.1, 1.5)
        memory = np.array([big + f, big + f - d, big / 4 + f])  # 16, 8 and 4 bits: exact bytes, not whole
        error = np.array([0.0, rng.uniform(0.01, 0.1), rng.uniform(0.2, 1.0)])
        p = ChoiceProblem(np.zeros(3, int), np.full(3, KINDS.index("qkv_input")), ["16", "8", "4"], memory,
                          np.zeros(3), error, np.zeros(1, int), np.full(1, 10.0), np.ones(1), False, np.zeros(1),
                          np.zeros(1), np.array([float(rng.randint(100, 200))]), 1.0)
        exact = [p.static_bytes[0] + m for m in memory]  # one layer, nothing else kept: its end of forward
        peaks = [p.evaluate(np.array([i]), np.zeros(1, bool))["peak_bytes_per_stage"][0] for i in range(3)]
        assert peaks == [int(np.ceil(e)) for e in exact], f"seed {seed}: the peak is the end of forward"
        budget = exact[0] + rng.uniform(0.01, 0.05)  # above 16 bits' exact bytes, below its whole bytes
        alloc = Solver(p).solve(budget, "error")
        assert [p.option[i] for i in alloc.chosen] == ["8"], f"seed {seed} trial {trial} budget {budget}"
        assert alloc.peak_bytes_per_stage[0] <= budget


def test_checkpointing_alone_equals_brute_force_and_rules_out_laaq_levels():
    """The checkpointing alternatives (agoq.search.problem.checkpointing_only: every option at 16, a layer kept or
    checkpointed whole) priced by counts: no layer can be under LAAQ, so every level with one is ruled out before
    any solve (its linear relaxation lets half-checkpointed layers off), and the fastest checkpointing that fits is
    brute force's."""
    seed, rng = fresh_rng()
    for trial in range(4):
        p = random_problem(rng, layers=rng.choice([3, 4]), kinds_per_layer=2)
        p.seconds[:] = 0.0
        p.checkpoint_seconds[:] = rng.uniform(0.5, 3.0)
        p.laaq_layer_seconds = rng.uniform(0.01, 0.5)  # the layer's time is a count: the levels answer
        p.allow_checkpoint = True
        q = checkpointing_only(p)
        solver = Solver(q)
        levels = solver._model.levels
        assert levels is not None and levels.most_under_laaq == 0, f"seed {seed}"
        L = q.num_layers
        assert all(levels._bound_fails(np.inf, n_u, n_c, None) for _, n_u, n_c in levels.levels if n_u + n_c < L)
        everything = [f for _, f in brute_force(q)]
        peaks = [max(f["peak_bytes_per_stage"]) for f in everything]
        for budget in (min(peaks), rng.uniform(min(peaks), max(peaks)), max(peaks)):
            best = min(f["step_seconds"] for f in everything if max(f["peak_bytes_per_stage"]) <= budget)
            alloc = solver.solve(budget, "time")
            assert alloc.step_seconds == pytest.approx(best, rel=1e-9, abs=1e-12), f"seed {seed} trial {trial}"
            assert max(alloc.peak_bytes_per_stage) <= budget, f"seed {seed} trial {trial}"
