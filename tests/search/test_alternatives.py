"""The alternatives a plan is priced against: bf16, the fastest fitting checkpointing (against brute force over
every subset of checkpointed layers), torch.compile's measured memory-budget points, and the plan's field."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from agoq.formats.plan import plan_from_dict
from agoq.formats.profile import load_profile
from agoq.search.alternatives import best_alternative, price_alternatives
from agoq.search.calibration import margin
from agoq.search.costs import (
    ProblemSettings,
    build_problem,
    checkpointing_only,
    compile_modes,
    state_parts,
    static_bytes_total,
)
from agoq.search.search import plan_from_profile
from tests.search.synthetic_profile import add_offload_rows, write_profile


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def _profile(tmp_path, rng, compiled: bool):
    """A 3-layer profile whose measured steps are eager (and compiled), with two compiled steps under torch.compile's
    activation_memory_budget when `compiled`."""
    modes = ("eager", "compiled") if compiled else ("eager",)
    folder = write_profile(tmp_path / "p", rng, num_layers=3, micro_batch=2, seq_len=29, compile_modes=modes)
    header = json.loads((folder / "profile.json").read_text())
    if compiled:
        rows = header["measured_steps"]["rows"]
        bf16 = next(r for r in rows if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"],
                                        r["optimizer"], r["master"]) == ("compiled", "bf16", 2, 1, "bf16", "adamw8bit",
                                                                         "fp32"))
        for b in (0.5, 0.1):
            rows.append({**bf16, "activation_memory_budget": b, "step_seconds": (1.05 + 0.1 * (1 - b)) * bf16["step_seconds"],
                         "peak_bytes": rng.randrange(10**6, 10**7)})
    (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder)


def test_checkpointing_alternative_is_the_fastest_fitting_subset(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, compiled=False)
    problem = build_problem(profile, ProblemSettings(optimizer="adamw8bit", master="fp32", micro_batch=2))
    ck = checkpointing_only(problem)
    L = problem.num_layers
    sixteen = np.nonzero(ck.keeps_16bit())[0]
    figures = {}
    for mask in itertools.product([False, True], repeat=L):
        m = np.array(mask)
        chosen = np.array([i for i in sixteen if not m[ck.layer[i]]], dtype=int)
        figures[mask] = ck.evaluate(chosen, m)
    peaks = sorted(max(f["peak_bytes_per_stage"]) for f in figures.values())
    budget = rng.randint(peaks[0], peaks[-1])
    fitting = {k: f for k, f in figures.items() if max(f["peak_bytes_per_stage"]) <= budget}
    want = min(f["step_seconds"] for f in fitting.values())
    priced = price_alternatives(profile, budget, [(2, 1)], ["eager"])
    mine = [a for a in priced if a.optimizer == "adamw8bit" and a.fits]
    assert mine, seed
    best = best_alternative(mine)
    assert best.step_seconds == pytest.approx(want, rel=1e-9), seed
    bf16 = next(a for a in priced if a.optimizer == "adamw8bit" and "bf16" in a.name)
    assert bf16.step_seconds == pytest.approx(figures[(False,) * L]["step_seconds"], rel=1e-12)
    assert bf16.peak_bytes == max(figures[(False,) * L]["peak_bytes_per_stage"])
    assert bf16.fits == (bf16.peak_bytes <= budget)


def test_compiled_points_move_with_the_optimizer(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, compiled=True)
    assert compile_modes(profile) == ["eager", "compiled"]
    priced = price_alternatives(profile, 10**12, [(2, 1)], ["eager", "compiled"])
    points = [a for a in priced if a.activation_memory_budget is not None]
    assert len(points) == 4  # two points x two optimizers
    rows = profile.header["measured_steps"]["rows"]
    measured = {r["activation_memory_budget"]: r for r in rows if r["activation_memory_budget"] is not None}

    def step(optimizer, master="fp32"):
        return next(r["step_seconds"] for r in rows if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"],
                                                        r["gradients"], r["optimizer"], r["master"],
                                                        r["activation_memory_budget"])
                    == ("compiled", "bf16", 2, 1, "bf16", optimizer, master, None))

    for a in points:
        # measured with the fused 8-bit AdamW: moved by the static bytes (AdamW's step transient too) and by what
        # AdamW's measured step took longer
        point = measured[a.activation_memory_budget]
        shift = static_bytes_total(profile, "bf16", a.optimizer, a.master) - static_bytes_total(profile, "bf16",
                                                                                                 "adamw8bit", "fp32")
        shift += state_parts(profile, "bf16", a.optimizer, a.master)["step_transient"]
        shift += margin(profile, "compiled")[0]  # the margin every compiled peak keeps (agoq.search.calibration)
        assert a.peak_bytes == int(point["peak_bytes"] + shift), seed
        assert a.step_seconds == pytest.approx(point["step_seconds"] + step(a.optimizer) - step("adamw8bit"),
                                               rel=1e-12), seed
    compiled_bf16 = next(a for a in priced if a.compile == "compiled" and "bf16" in a.name and a.optimizer == "adamw")
    assert compiled_bf16.step_seconds == pytest.approx(step("adamw"), rel=1e-12)
    assert best_alternative([]) is None


def test_plan_carries_the_best_alternative(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, compiled=False)
    problem = build_problem(profile)
    sixteen = np.nonzero(problem.keeps_16bit())[0]
    roomy = max(problem.evaluate(sixteen, np.zeros(3, dtype=bool))["peak_bytes_per_stage"])
    plan = plan_from_profile(profile, roomy, error_cap=None)
    assert plan.alternative is not None and plan.alternative.fits
    assert plan.alternative.predicted.peak_bytes <= roomy
    fits = [a for a in plan.alternatives if a.fits]
    assert plan.alternative.predicted.tokens_per_second == max(a.predicted.tokens_per_second for a in fits)
    tps = plan.decision.tokens_per_second
    assert plan.alternative.speedup_predicted == pytest.approx(tps / plan.alternative.predicted.tokens_per_second)
    assert plan.decision.objective == "time" and plan.decision.knobs["micro_batch"] * \
        plan.decision.knobs["grad_accum"] == 2
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.alternative == plan.alternative and again.decision == plan.decision


def test_checkpointed_inputs_offloaded_is_the_least_prefix_that_fits(tmp_path):
    """Where full checkpointing does not fit and the profile measured the host link, the alternatives offer full
    checkpointing with the first K layers' inputs in host memory: K the least that fits (against every K, priced by
    the problem itself), its figures those of that choice, and none offered at a budget no K reaches."""
    seed, rng = fresh_rng()
    link = {"d2h_bytes_per_second": rng.uniform(2e10, 6e10), "h2d_bytes_per_second": rng.uniform(2e10, 6e10),
            "bytes_per_copy": 256 << 20, "compute_slowdown": rng.uniform(0.0, 0.05), "pinnable_bytes": 10**11}
    # long sequences: the checkpointed inputs outweigh one layer's gradients, so offloading them lowers the peak
    folder = write_profile(tmp_path / "p", rng, num_layers=5, micro_batch=2, seq_len=1501, layer_forward=True,
                           host_link=link)
    add_offload_rows(folder, 5, lambda r: rng.uniform(0.0, 0.002))  # what a profile with a host link measures
    profile = load_profile(folder)
    knobs = ProblemSettings(gradient_mode="bf16", optimizer="adamw8bit", master="fp32", micro_batch=2)
    problem = build_problem(profile, knobs)
    assert problem.offload is not None, seed
    L = problem.num_layers
    ckpt = np.ones(L, dtype=bool)
    kept = np.array([i for i in np.nonzero(problem.keeps_16bit())[0] if not ckpt[problem.layer[i]]], dtype=int)
    by_k = [problem.evaluate(kept, ckpt, np.arange(L) < k) for k in range(L + 1)]
    peaks = [max(f["peak_bytes_per_stage"]) for f in by_k]
    least = min(peaks[1:])
    assert least < peaks[0], (seed, peaks)
    budget = rng.randint(least, peaks[0] - 1)
    want = next(k for k in range(1, L + 1) if peaks[k] <= budget)
    priced = price_alternatives(profile, budget, [(2, 1)], ["eager"])
    mine = [a for a in priced if a.optimizer == "adamw8bit" and "inputs offloaded" in a.name]
    assert len(mine) == 1, (seed, [a.name for a in priced])
    a = mine[0]
    assert a.fits and a.offload_layers == list(range(want)) and a.checkpoint_layers == list(range(L)), seed
    assert a.peak_bytes == peaks[want] and a.step_seconds == pytest.approx(by_k[want]["step_seconds"], rel=1e-12)
    assert f"{want}/{L} layers" in a.name
    field = a.as_plan_field()
    assert field["offload_layers"] == list(range(want)) and field["checkpoint_layers"] == list(range(L))
    unreachable = [x for x in price_alternatives(profile, least - 1, [(2, 1)], ["eager"])
                   if "inputs offloaded" in x.name]
    assert unreachable == [], seed


def test_validating_an_alternative_runs_its_checkpointed_and_offloaded_layers(tmp_path):
    """`agoq search --validate` runs the plan's alternative as priced: the plan handed to `measure` checkpoints and
    offloads exactly the alternative's layers, with its split, optimizer and bf16 gradients."""
    from agoq.search.search import measure_alternative

    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, compiled=False)
    problem = build_problem(profile)
    sixteen = np.nonzero(problem.keeps_16bit())[0]
    roomy = max(problem.evaluate(sixteen, np.zeros(3, dtype=bool))["peak_bytes_per_stage"])
    data = plan_from_profile(profile, roomy, error_cap=None).to_dict()
    ckpt, off = sorted(rng.sample(range(3), rng.randint(1, 3))), sorted(rng.sample(range(3), rng.randint(1, 3)))
    data["alternative"].update(checkpoint_layers=ckpt, offload_layers=off, micro_batch=1, grad_accum=2)
    plan = plan_from_dict(data)
    seen = []

    def measure(**kw):
        seen.append(kw)
        return {"step_seconds": 0.25, "peak_bytes": 1234, "first_step_peak_bytes": 1234, "losses": [1.0]}

    measure_alternative(plan, profile.model_config(), measure=measure, steps=2)
    (got,) = seen
    layers = got["plan"]["layers"]
    assert [lp["layer"] for lp in layers if lp["checkpoint"]] == ckpt, seed
    assert [lp["layer"] for lp in layers if lp["offload"]] == off, seed
    assert (got["micro_batch"], got["grad_accum"]) == (1, 2) and got["plan"]["gradients"]["mode"] == "bf16"
    assert plan.alternative.measured.peak_bytes == 1234


def test_without_masters_is_offered_where_the_search_may_drop_them(tmp_path):
    """Masters "none" in the search's space adds the 8-bit AdamW on bf16 parameters (no masters) to the
    alternatives, priced by the problem of those knobs; without it no alternative drops its masters."""
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, compiled=True)
    roomy = 10**12
    plain = price_alternatives(profile, roomy, [(2, 1)], ["eager", "compiled"])
    assert all(a.master == "fp32" for a in plain), seed
    both = price_alternatives(profile, roomy, [(2, 1)], ["eager", "compiled"], masters={"fp32", "none"})
    bare = [a for a in both if a.master == "none"]
    assert bare and all(a.optimizer == "adamw8bit" and "without masters" in a.name for a in bare), seed
    assert len(both) - len(plain) == len(bare)
    for mode in ("eager", "compiled"):
        problem = build_problem(profile, ProblemSettings(gradient_mode="bf16", optimizer="adamw8bit", master="none",
                                                         compile_mode=mode, micro_batch=2))
        want = problem.evaluate(np.nonzero(problem.keeps_16bit())[0], np.zeros(problem.num_layers, dtype=bool))
        got = next(a for a in bare if a.compile == mode and " bf16," in a.name)
        assert got.step_seconds == pytest.approx(want["step_seconds"], rel=1e-12), seed
        assert got.peak_bytes == max(want["peak_bytes_per_stage"]), seed
        with_masters = next(a for a in plain if a.compile == mode and " bf16," in a.name and a.optimizer == "adamw8bit")
        masters = state_parts(profile, "bf16", "adamw8bit", "fp32")["masters"]  # the masters are all they differ by
        assert with_masters.peak_bytes - got.peak_bytes == pytest.approx(masters, abs=2), seed


def test_alternatives_priced_beside_the_search_are_those_priced_after_it(tmp_path, monkeypatch):
    """The search prices the alternatives on agoq.search.highs.side_pool while it searches the combinations
    (plan_alternatives.alternatives_pricing): the plan must carry exactly what pricing them after the plan, from the
    combinations it tried, gives (the way without a head start), at budgets across the range, and the pricing must
    have run on the side thread. Below the least budget the search is refused, with the pricing finished or
    cancelled, and the side thread free for the next request."""
    import threading

    from agoq.search import alternatives, plan_alternatives, search
    from agoq.search.highs import side_pool
    from agoq.search.knobs import budget_bounds
    from agoq.search.request import InfeasibleBudget

    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, compiled=True)
    least, largest = budget_bounds(profile)
    threads = []
    real = alternatives.price_alternatives

    def noted(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_alternatives, "price_alternatives", noted)
    for budget in sorted(rng.randint(least, largest) for _ in range(3)):
        threads.clear()
        beside = plan_from_profile(profile, budget, error_cap=None).to_dict()
        assert threads and all(name.startswith("agoq-side") for name in threads), (seed, threads)
        with monkeypatch.context() as m:
            m.setattr(search, "alternatives_pricing", lambda *a, **k: None)
            threads.clear()
            after = plan_from_profile(profile, budget, error_cap=None).to_dict()
            assert threads == [threading.current_thread().name], (seed, threads)
        for d in (beside, after):
            d.pop("created", None)
            d.get("source", {}).pop("date", None)
        assert beside["alternatives"] and beside == after, (seed, budget)
    with pytest.raises(InfeasibleBudget):
        plan_from_profile(profile, least - 1 - rng.randrange(least // 2), error_cap=None)
    assert side_pool().submit(lambda: "free").result(timeout=5) == "free"


def test_a_plan_asking_for_the_same_pricing_reuses_alternatives_priced_for_another(tmp_path, monkeypatch):
    """attach_alternatives returns what it priced and over what (plan_alternatives.Priced): given to a second plan of
    the same search (the Optuna study's, agoq.search.search) they are reused where that plan asks for the same
    splits, compile modes, masters and layouts, and priced again where it asks for others, equal to pricing afresh."""
    from agoq.search import plan_alternatives
    from agoq.search.knobs import budget_bounds

    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, compiled=True)
    least, largest = budget_bounds(profile)
    budget = rng.randint(least, largest)
    plan = plan_from_profile(profile, budget, error_cap=None)
    calls, real = [], price_alternatives
    monkeypatch.setattr(plan_alternatives, "price_alternatives", lambda *a, **k: calls.append(k) or real(*a, **k))

    def copy(p):
        return plan_from_dict(p.to_dict())

    priced_first = copy(plan)
    first = plan_alternatives.attach_alternatives(priced_first, profile, budget)  # its splits etc. from the plan
    same = copy(plan)
    assert plan_alternatives.attach_alternatives(same, profile, budget, priced=first) is first and len(calls) == 1
    assert same.to_dict() == priced_first.to_dict() and same.alternatives, seed
    other = copy(plan)
    other.training.grad_accum = plan.training.grad_accum * rng.choice([2, 3])  # another batch split
    again = plan_alternatives.attach_alternatives(other, profile, budget, priced=first)
    assert len(calls) == 2 and again.asked["splits"] != first.asked["splits"], seed
    fresh = copy(other)
    plan_alternatives.attach_alternatives(fresh, profile, budget)
    assert other.to_dict() == fresh.to_dict(), seed
