"""The error a recompute from a quantized source adds (agoq.search.recompute_error), as the search counts it: the
gradient error it predicts for a choice is agoq.profiler.additivity's sum for the same policy, its MILP finds brute
force's optimum with that error (where leaving the term out would not), and every figure that reports an error (the
allocation, the plan and its quadrature, the one price, the recipe's cap) counts the same."""

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

import agoq.search.milp_model as milp_model
import agoq.search.milp_uniform as milp_uniform
from agoq.formats.profile import load_profile
from agoq.profiler.additivity import error_terms, predicted_error
from agoq.runtime.activations.policy import KEEP, KINDS, RECOMPUTABLE, ActivationPolicy, stage_aware_policy
from agoq.search.costs import ChoiceProblem, ProblemSettings, build_problem, recipe_error
from agoq.search.milp import InfeasibleBudget, Solver
from agoq.search.milp_model import FIRST_GAP
from agoq.search.milp_uniform import tie_break as ENUMERATED
from agoq.search.price import Configuration, price
from agoq.search.recompute_error import kind_sensitivities
from agoq.search.search import plan_from_profile
from tests.search.synthetic_profile import write_profile
from tests.search.test_milp import fresh_rng, one_setting_combos
from tests.search.test_milp_uniform import alike_problem, solve_as_brute_force


def reference_error(p: ChoiceProblem, chosen, terms: dict) -> float:
    """The predicted error of a choice, by hand: each chosen option's own error, and for each recompute option whose
    source kind's chosen option in its layer is b bits, terms[(layer, kind, b)] (the generator's own numbers)."""
    chosen = [int(i) for i in chosen]
    setting = {(int(p.layer[i]), KINDS[p.kind[i]]): p.option[i] for i in chosen}
    total = sum(float(p.error[i]) for i in chosen)
    for (l, kind), o in setting.items():
        if o == "recompute":
            source = setting[(l, RECOMPUTABLE[kind])]
            total += terms.get((l, kind, source), 0.0) if source != "16" else 0.0
    return total


def paired_problem(rng, layers: int, kinds: list, stages: int = 1):
    """A problem of `kinds` in every layer with random bytes, seconds and errors, a recompute option for each
    recomputable kind and the error a rebuild from its source at b bits adds (0.02-0.2 x 2^(4 - b), or none): the
    problem and {(layer, kind, bits): that error}."""
    layer, kind, option, memory, seconds, error, terms = [], [], [], [], [], [], {}
    for l in range(layers):
        for k in kinds:
            opts = ["16"] + rng.sample(["8", "5", "4", "3", "2"], rng.randint(1, 2))
            if k in RECOMPUTABLE:
                opts.append("recompute")
            big = rng.uniform(50, 150)
            for o in opts:
                layer.append(l), kind.append(KINDS.index(k)), option.append(o)
                if o == "16":
                    memory.append(round(big)), seconds.append(0.0), error.append(0.0)
                elif o == "recompute":
                    memory.append(rng.randint(0, 3)), seconds.append(rng.uniform(0.2, 1.0)), error.append(0.0)
                else:
                    memory.append(round(big * int(o) / 16 + rng.uniform(0, 3)))
                    seconds.append(rng.uniform(0.05, 0.3))
                    error.append(rng.uniform(0.01, 0.1) * 2.0 ** (4 - int(o)))
    pairs, pair_error = [], []
    for r, o in enumerate(option):
        if o != "recompute":
            continue
        source = KINDS.index(RECOMPUTABLE[KINDS[kind[r]]])
        for b, ob in enumerate(option):
            if layer[b] == layer[r] and kind[b] == source and ob != "16" and rng.random() < 0.85:
                t = rng.uniform(0.02, 0.2) * 2.0 ** (4 - int(ob))
                terms[(layer[b], KINDS[kind[r]], ob)] = t
                pairs.append((r, b)), pair_error.append(t)
    stage_of = np.sort(np.arange(layers) % stages)
    p = ChoiceProblem(
        np.array(layer), np.array(kind), option, np.array(memory, float), np.array(seconds, float),
        np.array(error, float), stage_of, np.array([rng.randint(10, 40) for _ in range(layers)], float),
        np.array([rng.uniform(1, 4) for _ in range(layers)]), rng.random() < 0.7,
        np.array([rng.randint(0, 30) for _ in range(layers)], float), np.zeros(layers),
        np.array([rng.randint(100, 200) for _ in range(stages)], float), 1.0,
        in_flight=np.array([rng.randint(1, 3) for _ in range(stages)], float),
        recompute_bytes=np.array([rng.randint(100, 400) for _ in range(layers)], float),
        pair_options=np.array(pairs, dtype=int).reshape(-1, 2), pair_error=np.array(pair_error, float))
    return p, terms


def every_choice(p: ChoiceProblem, terms: dict) -> list[tuple[dict, float]]:
    """Brute force: (figures, error by hand) of every choice, each layer its own setting or checkpointed."""
    groups = p.groups()
    per_layer = []
    for l in range(p.num_layers):
        mine = [idx for (gl, _), idx in sorted(groups.items()) if gl == l]
        per_layer.append([(c, False) for c in itertools.product(*mine)] + ([((), True)] if p.allow_checkpoint else []))
    out = []
    for combo in itertools.product(*per_layer):
        chosen = np.array([i for c, _ in combo for i in c], dtype=int)
        out.append((p.evaluate(chosen, np.array([k for _, k in combo])), reference_error(p, chosen, terms)))
    return out


@pytest.mark.parametrize("objective", ["error", "time"])
def test_milp_equals_brute_force_with_the_recompute_term(objective):
    """On random problems with recompute options and quantized sources, the MILP's allocation reports the error of
    its choice computed by hand, and its optimum (under random time or error caps) is brute force's."""
    seed, rng = fresh_rng()
    for trial in range(6):
        kinds = rng.choice([["norm_input", "qkv_input"], ["silu_input", "ffn2_input", "attention"],
                            ["norm_input", "qkv_input", "ffn1_input"]])
        p, terms = paired_problem(rng, layers=rng.choice([1, 2, 3]) if len(kinds) == 2 else rng.choice([1, 2]),
                                  kinds=kinds, stages=rng.choice([1, 2]) if len(kinds) == 2 else 1)
        if p.num_layers < p.num_stages:
            continue
        everything = every_choice(p, terms)
        for f, e in everything:
            assert f["grad_error"] == pytest.approx(e, rel=1e-12, abs=1e-15), f"seed {seed}: evaluate's error"
        solver = Solver(p)
        peaks = [max(f["peak_bytes_per_stage"]) for f, _ in everything]
        low, high = min(peaks), max(peaks)
        for budget in (low, rng.uniform(low, low + (high - low) / 5), rng.uniform(low, low + (high - low) / 3),
                       rng.uniform(low, high), high):
            times = [f["step_seconds"] for f, _ in everything]
            errors = [e for _, e in everything]
            time_cap = rng.uniform(min(times), max(times)) if objective == "error" and rng.random() < 0.6 else None
            error_cap = rng.uniform(min(errors), max(errors)) if objective == "time" and rng.random() < 0.7 else None
            fits = [(f, e) for f, e in everything if max(f["peak_bytes_per_stage"]) <= budget
                    and (time_cap is None or f["step_seconds"] <= time_cap + 1e-9)
                    and (error_cap is None or e <= error_cap + 1e-12)]
            where = f"seed {seed} trial {trial} budget {budget} caps {time_cap} {error_cap}"
            if not fits:
                with pytest.raises(InfeasibleBudget):
                    solver.solve(budget, objective, time_cap, error_cap=error_cap)
                continue
            alloc = solver.solve(budget, objective, time_cap, error_cap=error_cap)
            assert alloc.grad_error == pytest.approx(reference_error(p, alloc.chosen, terms), rel=1e-12), where
            got = alloc.grad_error if objective == "error" else alloc.step_seconds
            best = min(e if objective == "error" else f["step_seconds"] for f, e in fits)
            assert best - 1e-9 <= got <= best + FIRST_GAP * abs(best) + 1e-9, where
            assert max(alloc.peak_bytes_per_stage) <= budget + 1e-6, where
            if error_cap is not None:
                assert alloc.grad_error <= error_cap * (1 + 1e-7), where
            if time_cap is not None:
                assert alloc.step_seconds <= time_cap + 1e-6, where


def test_a_recompute_from_a_two_bit_source_is_no_longer_free():
    """One layer of norm_input (16 or 2 bits) and qkv_input (16, 4 bits or recompute): recomputing qkv_input from the
    2-bit norm_input keeps the fewest bytes and, without the term, the least error too. With it counted, the least
    error that fits stores qkv_input at 4 bits, as brute force says; the term left out, the MILP picks the
    recompute."""
    seed, rng = fresh_rng()
    n16, q16 = rng.uniform(90, 110), rng.uniform(90, 110)
    n2, q4 = round(n16 / 8 + rng.uniform(0, 2)), round(q16 / 4 + rng.uniform(0, 2))
    e_n2, e_q4 = rng.uniform(0.05, 0.15), rng.uniform(0.02, 0.06)
    t = rng.uniform(0.3, 0.6)  # qkv_input's own sensitivity at 2 bits: the rebuild carries it
    option = ["16", "2", "16", "4", "recompute"]
    p = ChoiceProblem(
        np.zeros(5, dtype=int), np.array([KINDS.index("norm_input")] * 2 + [KINDS.index("qkv_input")] * 3), option,
        np.array([round(n16), n2, round(q16), q4, 0.0]),
        np.array([0.0, 0.1, 0.0, rng.uniform(0.3, 0.5), rng.uniform(0.05, 0.2)]),  # the recompute the faster
        np.array([0.0, e_n2, 0.0, e_q4, 0.0]), np.zeros(1, dtype=int), np.array([1e9]), np.zeros(1), False,
        np.zeros(1), np.zeros(1), np.array([float(rng.randint(100, 200))]), 1.0, recompute_bytes=np.zeros(1),
        pair_options=np.array([[4, 1]]), pair_error=np.array([t]))
    terms = {(0, "qkv_input", "2"): t}
    budget = float(p.static_bytes[0]) + n2 + q4 + rng.uniform(0, 1)  # both stored quantized fit; norm at 16 does not
    everything = every_choice(p, terms)
    fits = [(f, e) for f, e in everything if max(f["peak_bytes_per_stage"]) <= budget]
    best = min(e for _, e in fits)
    assert best == pytest.approx(e_n2 + e_q4), seed
    alloc = Solver(p).solve(budget, "error")
    assert [p.option[i] for i in alloc.chosen] == ["2", "4"], seed
    assert alloc.grad_error == pytest.approx(best, rel=1e-12), seed
    blind = Solver(replace(p, pair_options=None, pair_error=None)).solve(budget, "error")  # before: the term unseen
    assert [p.option[i] for i in blind.chosen] == ["2", "recompute"], seed
    assert reference_error(p, blind.chosen, terms) == pytest.approx(e_n2 + t) and e_n2 + t > best, seed
    # under an error cap between the two, the fastest step stores qkv_input too: its faster recompute meets the cap
    # only with the term left out
    cap = (best + e_n2 + t) / 2
    assert [p.option[i] for i in Solver(p).solve(budget, "time", error_cap=cap).chosen] == ["2", "4"], seed
    blind = Solver(replace(p, pair_options=None, pair_error=None)).solve(budget, "time", error_cap=cap)
    assert [p.option[i] for i in blind.chosen] == ["2", "recompute"], seed


def test_compiled_alike_layers_enumerate_the_recompute_term(monkeypatch):
    """Compiled problems of alike layers (one setting per stage; agoq.search.milp_uniform's enumeration of the
    settings) whose setting recomputes qkv_input from a quantized norm_input: the fastest step, then the least error
    (counted by hand), then the fewest changes, as brute force; the enumeration answers some of them."""
    used = []

    def counting(m, seconds, counts, *args, **kwargs):
        out = ENUMERATED(m, seconds, counts, *args, **kwargs)
        used.append(out is not None and out.x is not None)
        return out

    monkeypatch.setattr(milp_model, "tie_break", counting)
    seed, rng = fresh_rng()
    for trial in range(8):
        while True:
            p = alike_problem(rng, layers=3, kinds=2)
            if len(p.pairs()[1]) and KINDS.index("norm_input") in set(p.kind):
                break
        terms = {(int(p.layer[r]), KINDS[p.kind[r]], p.option[b]): float(t) for (r, b), t in zip(*p.pairs())}
        is16 = p.keeps_16bit()
        everything = []
        for chosen, ckpt in one_setting_combos(p):
            f = p.evaluate(chosen, ckpt)
            f["grad_error"] = reference_error(p, chosen, terms)
            everything.append((f, int((~is16[chosen]).sum() + ckpt.sum())))
        peaks = [max(f["peak_bytes_per_stage"]) for f, _ in everything]
        errors = [f["grad_error"] for f, _ in everything]
        solver = Solver(p)
        for budget in (min(peaks), rng.uniform(min(peaks), max(peaks)), rng.uniform(min(peaks), max(peaks))):
            cap = rng.uniform(min(errors), max(errors)) if rng.random() < 0.5 else None
            where = f"seed {seed} trial {trial} budget {budget} cap {cap}"
            alloc = solve_as_brute_force(solver, everything, budget, cap, where)
            if alloc is not None:
                assert alloc.grad_error == pytest.approx(reference_error(p, alloc.chosen, terms), rel=1e-12), where
    assert any(used), f"seed {seed}: the enumeration never answered"


def _policy(settings: list[dict], fmt: str) -> ActivationPolicy:
    """The activation policy of a plan's per-layer settings (agoq.search.milp_model.Allocation.settings): a
    checkpointed layer keeps its kinds at 16 (its error is none)."""
    layers = {l: ({k: KEEP for k in KINDS} if s["checkpoint"] else dict(s["kinds"])) for l, s in enumerate(settings)}
    return ActivationPolicy(layers=layers, format=fmt)


def _profile_without_some_rows(tmp_path, rng):
    """A synthetic profile with its recompute rows read as noise (> 0) and a few rows of recomputable kinds missing,
    so that the term falls back on the source's row there; and its table with the recompute rows at 0 (the search's
    reading of them) for agoq.profiler.additivity."""
    L = rng.choice([3, 5])
    folder = write_profile(tmp_path / "p", rng, num_layers=L, bits=(8, 5, 4, 3, 2), stages=rng.choice([1, 2]))
    table = pd.read_parquet(folder / "profile.parquet")
    drop = np.zeros(len(table), dtype=bool)
    for _ in range(rng.randint(1, 3)):
        drop |= ((table.layer == rng.randrange(L)) & (table.kind == rng.choice(sorted(RECOMPUTABLE)))
                 & (table.option == rng.choice(["5", "3", "2"]))).to_numpy()
    table[~drop].to_parquet(folder / "profile.parquet")
    profile = load_profile(folder)
    exact = profile.table.copy()
    exact.loc[exact.option == "recompute", "sensitivity"] = 0.0
    return profile, exact, L, int(drop.sum())


def test_the_searchs_error_is_the_additivity_sum_of_its_policy(tmp_path):
    """On synthetic profiles (floors and attention's switch random, rows of recomputable kinds missing): every
    allocation the MILP returns, random choices priced by the one price, and plans with their quadrature, report
    agoq.profiler.additivity's error of the same policy; the recipe's cap is the recipe's sum."""
    seed, rng = fresh_rng()
    profile, exact, L, dropped = _profile_without_some_rows(tmp_path, rng)
    assert dropped > 0 and (profile.table.loc[profile.table.option == "recompute", "sensitivity"] > 0).any(), seed
    floors = tuple(sorted({(rng.choice(sorted(RECOMPUTABLE)), rng.choice([3, 4, 5])) for _ in range(rng.randint(0, 2))}))
    knobs = ProblemSettings(floor_bits=floors, quantize_attention=rng.random() < 0.5)
    problem = build_problem(profile, knobs)
    assert len(problem.pairs()[1]) > 0, seed
    in_flight = [int(round(n)) for n in problem.in_flight_counts()]
    recipe = stage_aware_policy(in_flight, L, [int(s) for s in problem.layer_stage])
    assert recipe_error(problem) == pytest.approx(predicted_error(exact, recipe, L, how="sum"), rel=1e-12), seed
    solver = Solver(problem)
    low = solver.smallest_budget()
    high = max(solver.solve(np.inf, "error").peak_bytes_per_stage)
    for budget in (low, rng.uniform(low, high), high * 1.01):
        for objective, caps in (("error", {}), ("time", {}), ("time", {"error_cap": rng.uniform(0.2, 2.0)})):
            try:
                alloc = solver.solve(budget, objective, **caps)
            except InfeasibleBudget:
                continue
            policy = _policy(alloc.settings(problem), knobs.format)
            want = predicted_error(exact, policy, L, how="sum")
            assert alloc.grad_error == pytest.approx(want, rel=1e-12, abs=1e-15), (seed, budget, objective, caps)
    for _ in range(20):  # random choices, through the one price
        kinds = tuple((l, KINDS[k], rng.choice([problem.option[i] for i in idx]))
                      for (l, k), idx in sorted(problem.groups().items()))
        config = Configuration(knobs, tuple(x for x in kinds if x[2] != "16"))
        got = price(profile, config, problem).grad_error
        policy = ActivationPolicy(layers={l: {k: (o if o == "recompute" else int(o)) for ll, k, o in kinds if ll == l}
                                          for l in range(L)})
        assert got == pytest.approx(predicted_error(exact, policy, L, how="sum"), rel=1e-12, abs=1e-15), seed
    least = solver.smallest_budget(None, recipe_error(problem))  # where the recipe's cap binds
    budget = int(math.ceil(rng.uniform(least, (least + high) / 2)))
    plan = plan_from_profile(profile, budget, knobs=knobs, objective="time", error_cap="recipe")
    policy = _policy([{"checkpoint": lp.checkpoint, "kinds": lp.kinds} for lp in plan.layers], knobs.format)
    terms = error_terms(exact, policy, L).values()
    assert plan.predicted.grad_error == pytest.approx(sum(terms), rel=1e-12, abs=1e-15), seed
    assert plan.predicted.grad_error_quadrature == pytest.approx(math.sqrt(sum(t * t for t in terms)), rel=1e-12,
                                                                 abs=1e-15), seed
    assert plan.predicted.grad_error <= recipe_error(problem) * (1 + 1e-9), seed


def test_the_kinds_row_is_the_one_the_search_prices_and_the_sources_where_missing():
    """kind_sensitivities: a recomputable kind's quantized rows, nf4's at 4 bits where the plan's format is nf4 and
    the profile measured it (int's where it did not), none of 16, recompute or other kinds; recompute_pairs falls back
    on the source option's own error where the kind has no row at the source's bits."""
    from agoq.search.recompute_error import recompute_pairs

    rng = random.Random(random.getrandbits(32))
    s = {name: rng.uniform(0.01, 0.5) for name in ("q4", "q4nf", "q3", "f4", "n4", "n4nf", "n3", "n2", "r", "a4")}
    rows = [(0, "qkv_input", "4", 4, "int", s["q4"]), (0, "qkv_input", "4", 4, "nf4", s["q4nf"]),
            (0, "qkv_input", "3", 3, "int", s["q3"]), (0, "qkv_input", "recompute", 0, "recompute", s["r"]),
            (0, "qkv_input", "16", 16, "bf16", 0.0), (0, "ffn1_input", "4", 4, "int", s["f4"]),
            (0, "norm_input", "4", 4, "int", s["n4"]), (0, "norm_input", "4", 4, "nf4", s["n4nf"]),
            (0, "norm_input", "3", 3, "int", s["n3"]), (0, "norm_input", "2", 2, "int", s["n2"]),
            (0, "attention", "4", 4, "int", s["a4"])]
    table = pd.DataFrame(rows, columns=["layer", "kind", "option", "bits", "format", "sensitivity"])
    assert kind_sensitivities(table, "int") == {(0, "qkv_input", "4"): s["q4"], (0, "qkv_input", "3"): s["q3"],
                                                (0, "ffn1_input", "4"): s["f4"]}
    assert kind_sensitivities(table, "nf4") == {(0, "qkv_input", "4"): s["q4nf"], (0, "qkv_input", "3"): s["q3"],
                                                (0, "ffn1_input", "4"): s["f4"]}

    class Profile:
        cache: dict = {}

    Profile.table = table
    norm, qkv = KINDS.index("norm_input"), KINDS.index("qkv_input")
    options = {"layer": np.zeros(6, dtype=int), "kind": np.array([norm] * 4 + [qkv] * 2),
               "option": ["16", "4", "3", "2", "16", "recompute"],
               "error": np.array([0.0, s["n4nf"], s["n3"], s["n2"], 0.0, 0.0])}
    out = recompute_pairs(Profile(), "nf4", options)
    got = {tuple(int(i) for i in pair): t for pair, t in zip(out["pair_options"], out["pair_error"])}
    assert got == {(5, 1): s["q4nf"], (5, 2): s["q3"], (5, 3): s["n2"]}  # at 2 bits: no qkv_input row, the source's


def test_settings_a_recompute_beats_are_not_enumerated():
    """Compiled alike layers (agoq.search.milp_uniform.settings): of the settings of the kinds' useful options, those
    left out are exactly the ones storing qkv_input at some bits where the same setting with qkv_input recomputed
    keeps no more bytes and, given norm_input's option in it, no more error in any layer (by hand from the problem's
    own options and pairs); and some are left out."""
    seed, rng = fresh_rng()
    left_out = 0
    for trial in range(12):
        while True:
            p = alike_problem(rng, layers=rng.randint(2, 4), kinds=2)
            if len(p.pairs()[1]) and KINDS.index("norm_input") in set(p.kind) and "recompute" in p.option:
                break
        m = milp_model.Model(p)
        alike = milp_uniform._alike(m)
        kinds, options = alike["kinds"], alike["options"]
        choice = milp_uniform.settings(m, alike)[0]
        got = {tuple(options[k][o] for k, o in zip(kinds, row)) for row in choice}
        useful = [[options[k][o] for o in range(len(options[k]))
                   if not milp_uniform.dominated(alike, k, o, options[k].index("16"))] for k in kinds]
        at = {(int(p.layer[i]), KINDS[p.kind[i]], p.option[i]): i for i in range(len(p.option))}
        term = {(int(p.layer[r]), p.option[b]): float(t) for (r, b), t in zip(*p.pairs())}
        qkv, norm = kinds.index(KINDS.index("qkv_input")), kinds.index(KINDS.index("norm_input"))

        def beaten(setting) -> bool:
            o, s = setting[qkv], setting[norm]
            if o in ("16", "recompute") or "recompute" not in useful[qkv]:
                return False
            mine, rec = at[(0, "qkv_input", o)], at[(0, "qkv_input", "recompute")]
            return p.memory[rec] <= p.memory[mine] and all(
                p.error[at[(l, "qkv_input", "recompute")]] + term.get((l, s), 0.0) <= p.error[at[(l, "qkv_input", o)]]
                for l in range(p.num_layers))

        every = set(itertools.product(*useful))
        want = {s for s in every if not beaten(s)}
        assert got == want, f"seed {seed} trial {trial}"
        left_out += len(every) - len(got)
    assert left_out > 0, f"seed {seed}: no setting was left out in 12 problems"
