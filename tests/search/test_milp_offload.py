"""Offload in the MILP against brute force: with a host link priced (ChoiceProblem.offload), every choice of
options, checkpointed layers and offloaded prefix is evaluated by the cost model's own `evaluate`, and the MILP
finds the same least step time at every budget, within the host budget; its plan's layers say which are offloaded."""

import itertools
import json
import random
import shutil
from dataclasses import replace

import numpy as np
import pytest

from agoq.formats.profile import load_profile
from agoq.search.knobs import budget_bounds
from agoq.search.milp import InfeasibleBudget, Solver
from agoq.search.milp_model import FIRST_GAP
from agoq.search.problem import OffloadPrices
from agoq.search.request import KnobSpace
from agoq.search.search import plan_from_profile
from tests.search.synthetic_profile import add_offload_rows, write_profile
from tests.search.test_milp import brute_force as kept_brute_force
from tests.search.test_milp import random_problem


def fresh_rng():
    seed = random.getrandbits(32)
    return seed, random.Random(seed)


def with_offload(rng, p, phases: bool = True):
    """`p` with random offload prices: a link whose time per byte makes some offloads exposed, a window, a slowdown,
    a host budget that sometimes binds, a time per offloaded layer, a floor under an offloading choice's peak, and
    sometimes what the step holds at a layer's backward beyond the end of forward (end_of_backward: the head's
    tensors freed, gradients made), which moves the start of backward, where the first prefetch lands (`phases`
    False: `p`'s own)."""
    bytes_per_layer = float(np.max(p.memory)) * 4
    link = rng.uniform(0.2, 2.0) / bytes_per_layer  # seconds per byte, out and back
    if phases and rng.random() < 0.6:
        p = replace(p, end_of_backward=np.round([rng.uniform(-1.5, 0.5) * bytes_per_layer
                                                 for _ in range(p.num_layers)]))
    return replace(p, offload=OffloadPrices(link_seconds_per_byte=link, window_seconds=rng.uniform(0.0, 1.5),
                                            seconds_per_byte=rng.uniform(0.0, 0.3) * link,
                                            # whole bytes, as a layer's are: ceil(host bytes) compares exactly
                                            host_budget_bytes=float(round(rng.uniform(0.5, 3.0) * bytes_per_layer)),
                                            grad_accum=rng.choice([1, 2]),
                                            forward_link_bytes=rng.choice([float("inf"),
                                                                           rng.uniform(0.1, 2.0) * bytes_per_layer]),
                                            # the runtime's own time per offloaded layer, sometimes none
                                            layer_seconds=rng.choice([0.0, rng.uniform(0.0, 0.5)]),
                                            # the measured least peak of an offloading choice, sometimes binding
                                            floor_bytes=rng.choice([0.0, float(p.static_bytes[0])
                                                                    + rng.uniform(0.0, 3.0) * bytes_per_layer]),
                                            # what an offloaded layer's backward allocates, sometimes nothing
                                            backward_bytes=rng.choice([0.0, float(round(
                                                rng.uniform(0.0, 1.5) * bytes_per_layer))])))


def brute_force(p):
    groups = p.groups()
    L = p.num_layers
    per_layer = []
    for l in range(L):
        mine = [idx for (gl, _), idx in sorted(groups.items()) if gl == l]
        choices = [(tuple(c), False) for c in itertools.product(*mine)]
        if p.allow_checkpoint:
            choices.append(((), True))
        per_layer.append(choices)
    out = []
    for combo in itertools.product(*per_layer):
        chosen = np.array([i for c, _ in combo for i in c], dtype=int)
        ckpt = np.array([k for _, k in combo])
        for k in range(L + 1):
            off = np.arange(L) < k
            if (off & ckpt).any():
                break
            f = p.evaluate(chosen, ckpt, off)
            if f["host_bytes"] > p.offload.host_budget_bytes:
                break
            out.append((f, off))
    return out


def test_offload_prefix_matches_brute_force():
    seed, rng = fresh_rng()
    for trial in range(6):
        p = with_offload(rng, random_problem(rng, layers=3, kinds_per_layer=2, stages=1))
        p = replace(p, in_flight=np.ones(1))
        everything = brute_force(p)
        solver = Solver(p)
        peaks = [max(f["peak_bytes_per_stage"]) for f, _ in everything]
        low, high = min(peaks), max(peaks)
        budgets = [low, rng.uniform(low, high), rng.uniform(low, high), high]
        rng.shuffle(budgets)  # one solver, budgets in any order: a smaller one reuses what a larger ruled out
        for budget in budgets:
            fits = [(f, off) for f, off in everything if max(f["peak_bytes_per_stage"]) <= budget]
            if not fits:
                with pytest.raises(InfeasibleBudget):
                    solver.solve(budget, "time")
                continue
            best = min(f["step_seconds"] for f, _ in fits)
            alloc = solver.solve(budget, "time")
            where = f"seed {seed} trial {trial} budget {budget}"
            assert best - 1e-9 <= alloc.step_seconds <= best * (1 + FIRST_GAP) + 1e-9, where
            assert max(alloc.peak_bytes_per_stage) <= budget + 1, where
            assert alloc.host_bytes <= p.offload.host_budget_bytes, where
            off = alloc.offloaded()
            k = int(off.sum())
            assert off[:k].all() and not (off & alloc.checkpoint).any(), where  # a prefix, none checkpointed
            settings = alloc.settings(p)
            assert [bool(s.get("offload")) for s in settings] == list(off), where
            # the figures the allocation carries are the cost model's own for its choice
            f = p.evaluate(alloc.chosen, alloc.checkpoint, off)
            assert f["host_bytes"] == alloc.host_bytes and f["step_seconds"] == pytest.approx(alloc.step_seconds)
            # its ties broken by the least error, whichever offloaded prefix they take
            mine = alloc.step_seconds * (1 + 1e-9) + 1e-12
            least_error = min(f["grad_error"] for f, _ in fits if f["step_seconds"] <= mine)
            assert alloc.grad_error == pytest.approx(least_error, rel=1e-6, abs=1e-9), where
            # the other objective: the least error that fits, its ties broken by the least time
            exact = solver.solve(budget, "error")
            least = min(f["grad_error"] for f, _ in fits)
            assert least - 1e-9 <= exact.grad_error <= least * (1 + FIRST_GAP) + 1e-9, where
            fastest = min(f["step_seconds"] for f, _ in fits if f["grad_error"] <= exact.grad_error + 1e-9)
            assert exact.step_seconds == pytest.approx(fastest, rel=1e-6, abs=1e-9), where


def test_offload_is_not_chosen_where_it_buys_nothing():
    """At a budget everything fits in, nothing is offloaded (it costs time), and without prices nothing can be."""
    seed, rng = fresh_rng()
    p = with_offload(rng, random_problem(rng, layers=3, kinds_per_layer=2, stages=1))
    alloc = Solver(p).solve(1e12, "time")
    assert not alloc.offloaded().any() and alloc.host_bytes == 0, f"seed {seed}"
    plain = replace(p, offload=None)
    with pytest.raises(ValueError, match="offers no offload"):
        plain.evaluate(alloc.chosen, alloc.checkpoint, np.ones(3, dtype=bool))


def test_exposed_link_time_is_priced():
    """The step time of an offload is the exposed link time (x accumulation) plus the slowdown per byte plus the
    runtime's time per offloaded layer: a closed form checked on the cost model."""
    seed, rng = fresh_rng()
    p = with_offload(rng, random_problem(rng, layers=4, kinds_per_layer=2, stages=1))
    sixteen = np.nonzero(p.keeps_16bit())[0]
    none = np.zeros(4, dtype=bool)
    base = p.evaluate(sixteen, none)
    off = np.array([True, True, False, False])
    f = p.evaluate(sixteen, none, off)
    o = p.offload
    host = f["host_bytes"]
    assert max(f["peak_bytes_per_stage"]) >= max(base["peak_bytes_per_stage"]) - host  # what left the GPU, at most
    assert host > 0
    expected = o.grad_accum * max(0.0, host * o.link_seconds_per_byte - o.window_seconds) + host * o.seconds_per_byte \
        + 2 * o.layer_seconds
    assert f["step_seconds"] - base["step_seconds"] == pytest.approx(expected, rel=1e-9, abs=1e-12), f"seed {seed}"
    assert f["offload_link_seconds"] == pytest.approx(host * o.link_seconds_per_byte)


def link_profile(folder, rng):
    """A 5-layer synthetic profile that measured a random host link: (folder, its host link, the least budget that
    fits, the least that fits without offload)."""
    link = {"d2h_bytes_per_second": rng.uniform(2e10, 6e10), "h2d_bytes_per_second": rng.uniform(2e10, 6e10),
            "bytes_per_copy": 256 << 20, "compute_slowdown": rng.uniform(0.0, 0.05), "pinnable_bytes": 10**11}
    folder = write_profile(folder, rng, num_layers=5, layer_forward=True, host_link=link)
    add_offload_rows(folder, 5, lambda r: rng.uniform(0.0, 0.002))  # what a profile with a host link measures
    profile = load_profile(folder)
    without, _ = budget_bounds(profile, KnobSpace(offload=False))
    least, _ = budget_bounds(profile)
    return folder, link, least, without


def test_a_profile_with_a_host_link_plans_offload_below_what_fits_without(tmp_path):
    """From a profile that measured the host link, a budget below the least that fits without offload gets a plan
    that offloads a prefix of layers: valid, within its budget and host budget, its memory parts adding up to its
    peak; with offload off the same budget is refused; a profile without a host link never offloads."""
    seed, rng = fresh_rng()
    folder, link, least, without = link_profile(tmp_path / "p", rng)
    profile = load_profile(folder)
    assert least < without, f"seed {seed}"
    budget = (least + without) // 2
    plan = plan_from_profile(profile, budget, error_cap=None)
    offloaded = plan.offload_layers()
    assert offloaded and offloaded == list(range(len(offloaded))), f"seed {seed}"
    assert max(plan.predicted.peak_bytes_per_stage) <= budget
    assert 0 < plan.predicted.host_bytes <= plan.host_budget_bytes == link["pinnable_bytes"]
    for stage in plan.predicted.memory_per_stage:
        assert sum(stage.parts.values()) == plan.predicted.peak_bytes_per_stage[stage.stage]
    with pytest.raises(InfeasibleBudget):
        plan_from_profile(profile, budget, error_cap=None, space=KnobSpace(offload=False))
    header = json.loads((folder / "profile.json").read_text())
    del header["timing"]["host_link"]  # the same profile, made where the host link was not measured
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "profile.json").write_text(json.dumps(header))
    assert budget_bounds(load_profile(bare))[0] == without


def test_what_forward_cannot_copy_out_stays_on_the_gpu():
    """Offloaded bytes beyond what the link copies out during forward are still on the GPU at forward's peak: the
    peak rises by max(0, host bytes - forward_link_bytes) over the same offload with an unbounded link."""
    seed, rng = fresh_rng()
    p = with_offload(rng, random_problem(rng, layers=4, kinds_per_layer=2, stages=1))
    p = replace(p, floor_bytes=None, allow_checkpoint=False,  # the end of forward sets the peak: backward's phases
                offload=replace(p.offload, floor_bytes=0.0),  # are below it, the head's tensors far larger than the
                end_of_backward=np.full(4, -10.0 * float(np.max(p.memory)) * 4))  # gradients made
    sixteen = np.nonzero(p.keeps_16bit())[0]
    none, off = np.zeros(4, dtype=bool), np.array([True, True, True, False])
    fast = replace(p, offload=replace(p.offload, forward_link_bytes=float("inf")))
    free = fast.evaluate(sixteen, none, off)
    limit = rng.uniform(0.1, 0.9) * free["host_bytes"]
    slow = replace(p, offload=replace(p.offload, forward_link_bytes=limit))
    got = slow.evaluate(sixteen, none, off)
    assert got["host_bytes"] == free["host_bytes"]
    assert got["peak_bytes_per_stage"][0] - free["peak_bytes_per_stage"][0] == pytest.approx(
        free["host_bytes"] - limit, abs=1.0), f"seed {seed}"
    parts = slow.memory_parts(sixteen, none, off)[0]["parts"] if slow.static_parts is not None else None
    assert parts is None or parts.get("offload_backlog", 0) > 0


def test_count_priced_offload_matches_brute_force():
    """Compiled pricing with offload (every option 0 s, checkpointing the same seconds in every layer): step seconds
    are a level's plus the link's price, and the fastest choice is found from the levels with every layer kept,
    then every faster level ruled out (agoq.search.milp_levels), or by the whole MILP where offload may win. Same
    optimum as brute force at budgets where offloading wins and where it does not, its ties broken by the least
    error; the relaxed bound is never above the optimum."""
    seed, rng = fresh_rng()
    for trial in range(5):
        p = with_offload(rng, random_problem(rng, layers=3, kinds_per_layer=2, stages=1))
        p = replace(p, in_flight=np.ones(1))
        p.seconds[:] = 0.0
        p.checkpoint_seconds[:] = rng.uniform(0.5, 3.0)
        p.laaq_layer_seconds = rng.choice([rng.uniform(-0.2, -0.01), rng.uniform(0.01, 0.5)])
        solver = Solver(p)
        assert solver._model.levels is not None, "the problem is count-priced: its levels are used"
        everything = brute_force(p)
        peaks = [max(f["peak_bytes_per_stage"]) for f, _ in everything]
        low, high = min(peaks), max(peaks)
        kept_low = min(max(f["peak_bytes_per_stage"]) for f, off in everything if not off.any())
        for budget in (low, rng.uniform(low, kept_low), kept_low, rng.uniform(kept_low, high), high):
            fits = [f for f, _ in everything if max(f["peak_bytes_per_stage"]) <= budget]
            where = f"seed {seed} trial {trial} budget {budget}"
            if not fits:
                with pytest.raises(InfeasibleBudget):
                    solver.solve(budget, "time")
                continue
            best = min(f["step_seconds"] for f in fits)
            bound = solver.relaxed_bound(budget, "time")
            assert bound is not None and bound <= best + 1e-9, where
            alloc = solver.solve(budget, "time")
            # exact where the levels answer; the whole MILP's answer is within its relative gap (FIRST_GAP)
            assert best - 1e-12 <= alloc.step_seconds <= best * (1 + FIRST_GAP) + 1e-12, where
            mine = alloc.step_seconds * (1 + 1e-9) + 1e-12  # the ties it broke: choices at least as fast as its own
            least_error = min(f["grad_error"] for f in fits if f["step_seconds"] <= mine)
            assert alloc.grad_error == pytest.approx(least_error, rel=1e-6, abs=1e-9), where
            assert max(alloc.peak_bytes_per_stage) <= budget + 1, where


def test_the_peak_is_the_largest_of_forward_and_backward_phases():
    """An offloaded choice's peak is the largest of the end of forward (the peak without offload less the bytes on
    the host), the start of backward (that, plus the largest offloaded layer's bytes and the top layer's
    end_of_backward bytes) with an offloaded layer's backward on top (backward_bytes), and the backward of offloaded
    layers 0 and 1 (the state, their end_of_backward bytes, the largest offloaded layer's bytes at layer 0 and the
    two largest at layer 1, and backward_bytes). Each offloaded layer's bytes are told apart from the host bytes of
    growing prefixes; the phase and the memory parts say which, and the parts add up to the peak."""
    seed, rng = fresh_rng()
    for trial in range(30):
        L = rng.randint(3, 7)
        p = random_problem(rng, layers=L, kinds_per_layer=rng.randint(1, 4), stages=1)
        p = replace(with_offload(rng, p), in_flight=np.ones(1), floor_bytes=None, laaq_transient_bytes=None)
        scale = float(np.max(p.memory))
        d = rng.choice([0.0, float(round(rng.uniform(0.0, 3.0) * scale))])
        p = replace(p, offload=replace(p.offload, forward_link_bytes=float("inf"), floor_bytes=0.0,
                                       host_budget_bytes=float("inf"), backward_bytes=d))
        groups = p.groups()
        chosen = np.array([rng.choice(list(idx)) for _, idx in sorted(groups.items())], dtype=int)
        none = np.zeros(L, dtype=bool)
        k = rng.randint(1, L)
        host = [p.evaluate(chosen, none, np.arange(L) < j)["host_bytes"] for j in range(k + 1)]
        each = sorted(host[j + 1] - host[j] for j in range(k))
        kept = p.evaluate(chosen, none)["peak_bytes_per_stage"][0]
        static = float(p.static_bytes[0])
        for trial_top in range(2):
            eob = np.array([rng.uniform(-3.0, 2.0) * scale for _ in range(L)])
            if trial_top == 0:  # a head far larger than the gradients: the end of forward or the start sets it
                eob[:] = -(each[-1] + 20 * scale)
                eob[L - 1] = rng.uniform(-each[-1], 2.0 * scale)
            q = replace(p, end_of_backward=eob)
            f = q.evaluate(chosen, none, np.arange(L) < k)
            end_of_forward = kept - host[k]
            phases = {"forward_backward": end_of_forward,
                      "backward_start": end_of_forward + each[-1] + eob[L - 1],
                      "at 0": static + eob[0] + each[-1] + d}
            phases["offload_backward"] = phases["backward_start"] + d
            if k >= 2:
                phases["at 1"] = static + eob[1] + each[-1] + each[-2] + d
            where = f"seed {seed} trial {trial} {trial_top}"
            expected = max(phases.values())
            assert f["peak_bytes_per_stage"][0] == pytest.approx(expected, abs=1.0), where
            close = {name for name, v in phases.items() if abs(v - expected) <= 1.0}
            name = f["peak_phase_per_stage"][0]
            assert name in close or (name == "offload_backward" and close & {"at 0", "at 1"}), where
            if q.static_parts is not None:
                parts = q.memory_parts(chosen, none, np.arange(L) < k)[0]
                assert sum(parts["parts"].values()) == f["peak_bytes_per_stage"][0], where


def test_an_offloading_plan_with_knobs_its_offload_price_never_ran_says_so():
    """The offload price comes from the profile's offloading step (bf16 gradients, no checkpointed layer): a plan that
    offloads with QuanGrad's gradients or checkpointed layers says which of them it adds, one that offloads without
    them says nothing, whichever budgets of the committed H100 probe profile give them."""
    from pathlib import Path

    from agoq.search.search import search

    profile = load_profile(Path(__file__).resolve().parents[2] / "experiments/results/profiles/probe-h100-link")
    seed, rng = fresh_rng()
    seen = {True: 0, False: 0}
    # at 10.35-10.36 GB the plan is its checkpointing alternative (no offload): from 10.37 GB it offloads 6-8 layers
    # with 1-7 checkpointed (both at 3db342b and after; 12 budgets 10.35-10.55 GB)
    for budget in [rng.uniform(10.37e9, 10.55e9), rng.uniform(11.1e9, 14.2e9), 10026207569]:
        plan = search(profile, int(budget), method="milp", front_budgets=0, validate=0, progress=False).plan
        if not plan.offload_layers():
            continue
        notes = [n for n in plan.source.notes if n.startswith("offload is priced from the profile's offloading step")]
        quangrad, checkpointed = plan.gradients.mode != "bf16", bool(plan.checkpoint_layers())
        assert len(notes) == (1 if quangrad or checkpointed else 0), (budget, notes)
        if notes:
            assert ("QuanGrad" in notes[0]) == quangrad, (budget, notes[0])
            assert (f"{len(plan.checkpoint_layers())} checkpointed layer(s)" in notes[0]) == checkpointed, budget
        seen[bool(notes)] += 1
    assert seen[True] >= 1, f"seed {seed}: a budget 10.37-10.55 GB gives an offloading plan with checkpointed layers"


def test_improves_equals_brute_force():
    """Solver.improves (is there a choice under the budget and the caps better than a value?) against brute force,
    with and without offload (one MILP per offloaded prefix, the first choice found ends it), at values just below,
    at and just above the best that fits, and a random one between the best and the worst; some problems priced by
    counts (every option 0 s: the levels answer where nothing is offloaded)."""
    seed, rng = fresh_rng()
    for trial in range(8):
        p = replace(random_problem(rng, layers=3, kinds_per_layer=2, stages=1), in_flight=np.ones(1))
        if trial % 2:
            p.seconds[:] = 0.0
            p.checkpoint_seconds[:] = rng.uniform(0.5, 3.0)
        p = with_offload(rng, p) if rng.random() < 0.6 else p
        everything = brute_force(p) if p.offload is not None else [(f, None) for _, f in kept_brute_force(p)]
        solver = Solver(p)
        peaks = [max(f["peak_bytes_per_stage"]) for f, _ in everything]
        for budget in (min(peaks), rng.uniform(min(peaks), max(peaks)), max(peaks)):
            for objective, key in (("time", "step_seconds"), ("error", "grad_error")):
                other = "grad_error" if key == "step_seconds" else "step_seconds"
                values = [f[other] for f, _ in everything]
                cap = rng.uniform(min(values), max(values)) if rng.random() < 0.4 else None
                caps = {"error_cap" if other == "grad_error" else "time_cap": cap}
                fits = [f[key] for f, _ in everything if max(f["peak_bytes_per_stage"]) <= budget
                        and (cap is None or f[other] <= cap * (1 + 1e-9) + 1e-12)]
                if not fits:
                    assert not solver.improves(budget, objective, np.inf, **caps)
                    continue
                best, worst = min(fits), max(fits)
                for value in (best * (1 - 1e-3) - 1e-6, best, best * (1 + 1e-3) + 1e-6, rng.uniform(best, worst)):
                    want = any(v < value for v in fits)
                    got = solver.improves(budget, objective, value, **caps)
                    assert got == want, f"seed {seed} trial {trial} budget {budget} {objective} {caps} {value}"


def test_the_time_limit_of_improves_is_the_milps_not_the_prefixes_relaxations(monkeypatch):
    """Which constraints bind a plan is asked of Solver.improves with a time limit of 0.3 s; with offload it first
    solves one relaxation per offloaded prefix. Those must not use up the limit: with every LP slowed far past it
    (as a loaded machine slows them), improves still answers as brute force does where a choice beats the value."""
    import time as clock

    from agoq.search import milp_model

    seed, rng = fresh_rng()
    real = milp_model.milp

    def slow_lps(c, **kwargs):
        if not np.any(kwargs.get("integrality", np.ones(1))):
            clock.sleep(0.08)
        return real(c, **kwargs)

    real_warm = milp_model.WarmLP.solve

    def slow_warm(self, bounds):  # the prefixes' relaxations, one after another from the last one's basis
        clock.sleep(0.08)
        return real_warm(self, bounds)

    asked = 0
    for trial in range(6):
        if asked == 2:
            break
        p = with_offload(rng, replace(random_problem(rng, layers=3, kinds_per_layer=2, stages=1),
                                      in_flight=np.ones(1)))
        everything = brute_force(p)
        peaks = [max(f["peak_bytes_per_stage"]) for f, _ in everything]
        budget = rng.uniform(min(peaks), max(peaks))
        fits = sorted(f["grad_error"] for f, _ in everything if max(f["peak_bytes_per_stage"]) <= budget)
        if len(set(fits)) < 2:
            continue
        value = (fits[0] + fits[1]) / 2 if fits[1] > fits[0] else fits[-1] + 1.0  # the least fitting error beats it
        with monkeypatch.context() as m:
            m.setattr(milp_model, "milp", slow_lps)
            m.setattr(milp_model.WarmLP, "solve", slow_warm)
            started = clock.perf_counter()
            got = Solver(p).improves(budget, "error", value, time_limit=0.1)
            took = clock.perf_counter() - started
        assert got, f"seed {seed} trial {trial}: a choice of error {fits[0]} beats {value} (took {took:.2f} s)"
        asked += 1
    assert asked, f"seed {seed}: no trial had two fitting errors"
