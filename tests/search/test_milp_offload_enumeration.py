"""agoq.search.milp_offload against brute force: compiled problems of alike layers (one LAAQ setting per stage, every
(kind, option) the same bytes in every layer, errors by layer) with a host link priced, so that a prefix of layers
may be offloaded. Every choice of setting, layer states and offloaded prefix is evaluated by the cost model's own
`evaluate`; the solver's answer must be brute force's: the fastest step, then the least error, then the fewest
changed tensors (options not at 16, checkpointed and offloaded layers), within the budget, the error cap and the
host budget."""

from dataclasses import replace

import numpy as np
import pytest

import agoq.search.milp_offload as milp_offload
from agoq.search.milp import InfeasibleBudget, Solver
from tests.search.test_milp import fresh_rng, one_setting_combos
from tests.search.test_milp_offload import with_offload
from tests.search.test_milp_uniform import alike_problem, lexicographic_best


def every_choice(p):
    """(figures, changed tensors, offloaded) of every choice keeping one setting per stage, every prefix offloaded
    that holds no checkpointed layer and fits the host budget."""
    is16 = p.keeps_16bit()
    out = []
    for chosen, ckpt in one_setting_combos(p):
        changed = int((~is16[chosen]).sum() + ckpt.sum())
        for k in range(p.num_layers + 1):
            off = np.arange(p.num_layers) < k
            if (off & ckpt).any():
                break
            f = p.evaluate(chosen, ckpt, off if k else None)
            if f["host_bytes"] > p.offload.host_budget_bytes:
                break
            out.append((f, changed + k, off))
    return out


def _problem(rng, checkpoint: bool, falls: bool):
    layers = 4
    p = alike_problem(rng, layers=layers, kinds=2)
    p.allow_checkpoint = checkpoint
    p.laaq_layer_seconds = rng.uniform(0.5, 6.0) if checkpoint else rng.uniform(0.01, 0.5)
    if falls:  # a checkpointed layer's backward holds the gradients made by then: its rerun falls with height
        # (whole bytes, as every other amount here: the cost model rounds a peak up to a whole byte)
        p.end_of_backward = (layers - np.arange(layers)) * float(rng.randint(1, 8)) - float(rng.randint(0, 50))
    if rng.random() < 0.8:  # recomputed kinds keep a few bytes: no setting keeps nothing (else the MILP answers)
        for k in set(p.kind[np.array([o == "recompute" for o in p.option], bool)]):
            p.memory[(p.kind == k) & np.array([o == "recompute" for o in p.option])] = float(rng.randint(1, 9))
    elif rng.random() < 0.6:  # the same in every layer: the head's tensors freed, less the gradients made, moves
        # the start of backward (where the first prefetch lands) against the end of forward
        p.end_of_backward = np.full(layers, float(round(rng.uniform(-1.5, 0.5) * float(np.max(p.memory)) * 4)))
    p = with_offload(rng, p, phases=False)
    if rng.random() < 0.5:  # nothing allocated on top of an offloaded layer's backward: offloading fits more often
        p = replace(p, offload=replace(p.offload, backward_bytes=0.0))
    if np.isfinite(p.offload.forward_link_bytes):  # whole bytes, as every other amount (a peak is rounded up)
        p = replace(p, offload=replace(p.offload, forward_link_bytes=float(round(p.offload.forward_link_bytes))))
    # the measured offloading step's floor too: a fractional one fits a budget above it that its rounded peak
    # does not (seen: floor 1188.74 against a budget of 1188.92)
    p = replace(p, offload=replace(p.offload, floor_bytes=float(np.ceil(p.offload.floor_bytes))))
    if rng.random() < 0.5:  # a cheaper link and no floor: offloading wins more often
        p = replace(p, offload=replace(p.offload, link_seconds_per_byte=p.offload.link_seconds_per_byte / 10,
                                       seconds_per_byte=p.offload.seconds_per_byte / 10, floor_bytes=0.0))
    elif rng.random() < 0.3:  # a link whose copies hide under the window at no price: offloading ties in time, and
        # the fewest changed tensors (an offloaded layer is one) decide
        p = replace(p, offload=replace(p.offload, seconds_per_byte=0.0, window_seconds=1e9, layer_seconds=0.0))
    return p


def _check(monkeypatch, checkpoint: bool, falls: bool, trials: int, at_least: int):
    answered = {"fastest": 0, "fastest_offloaded": 0, "tie_break": 0, "offloaded": 0, "calls": 0}
    fastest, ties = milp_offload.Enumeration.fastest, milp_offload.Enumeration.tie_break

    def counting_fastest(self, *args, **kwargs):
        out = fastest(self, *args, **kwargs)
        answered["calls"] += 1
        answered["fastest"] += out is not None
        answered["fastest_offloaded"] += out is not None and out.x is not None and bool(np.round(out.x[self.m.o0]))
        return out

    def counting_ties(self, *args, **kwargs):
        out = ties(self, *args, **kwargs)
        answered["calls"] += 1
        answered["tie_break"] += out is not None
        answered["offloaded"] += out is not None and bool(np.round(out.x[self.m.o0]))
        return out

    monkeypatch.setattr(milp_offload.Enumeration, "fastest", counting_fastest)
    monkeypatch.setattr(milp_offload.Enumeration, "tie_break", counting_ties)
    seed, rng = fresh_rng()
    monkeypatch.setattr(milp_offload, "CHUNK", rng.choice([1, 2, 3, 4096]))  # the bound decides which are settled
    for trial in range(trials):
        p = _problem(rng, checkpoint, falls)
        everything = every_choice(p)
        peaks = [max(f["peak_bytes_per_stage"]) for f, _, _ in everything]
        errors = [f["grad_error"] for f, _, _ in everything]
        kept = [max(f["peak_bytes_per_stage"]) for f, _, off in everything if not off.any()]
        solver = Solver(p)
        low, high, kept_low = min(peaks), max(peaks), min(kept)
        for budget in (low, rng.uniform(low, kept_low), rng.uniform(low, kept_low), kept_low,
                       rng.uniform(kept_low, high), high):
            budget = float(np.floor(budget)) + rng.choice([0.0, 0.37])  # at non-round sizes too
            cap = rng.uniform(min(errors), max(errors)) if rng.random() < 0.5 else None
            fits = [(f, n, off) for f, n, off in everything if max(f["peak_bytes_per_stage"]) <= budget
                    and (cap is None or f["grad_error"] <= cap + 1e-12)]
            where = f"seed {seed} trial {trial} budget {budget} cap {cap}"
            if not fits:
                with pytest.raises(InfeasibleBudget):
                    solver.solve(budget, "time", error_cap=cap)
                continue
            best, least_error, fewest = lexicographic_best([(f, n) for f, n, _ in fits])
            alloc = solver.solve(budget, "time", error_cap=cap)
            off = alloc.offloaded()
            assert alloc.step_seconds == pytest.approx(best, rel=1e-9, abs=1e-12), where
            assert alloc.grad_error == pytest.approx(least_error, rel=1e-6, abs=1e-9), where
            changed = int((~p.keeps_16bit()[alloc.chosen]).sum() + alloc.checkpoint.sum() + off.sum())
            assert changed == fewest, where
            assert max(alloc.peak_bytes_per_stage) <= budget, where
            assert alloc.host_bytes <= p.offload.host_budget_bytes, where
            k = int(off.sum())
            assert off[:k].all() and not (off & alloc.checkpoint).any(), where
    # where the structure holds, the enumeration answers: a choice it finds always checks out
    assert answered["calls"] == answered["fastest"] + answered["tie_break"], f"seed {seed}: {answered}"
    assert answered["tie_break"] >= at_least and answered["offloaded"] >= 1 and answered["fastest_offloaded"] >= 1, \
        f"seed {seed}: the enumeration answered too seldom to be tested: {answered}"


def test_offloaded_prefix_enumeration_equals_brute_force(monkeypatch):
    _check(monkeypatch, checkpoint=False, falls=False, trials=8, at_least=2)


def test_offloaded_prefix_with_checkpointed_layers_equals_brute_force(monkeypatch):
    _check(monkeypatch, checkpoint=True, falls=False, trials=8, at_least=2)


def test_offloaded_prefix_with_checkpointed_backward_falling_with_height_equals_brute_force(monkeypatch):
    _check(monkeypatch, checkpoint=True, falls=True, trials=8, at_least=2)


def test_each_configuration_least_error_equals_brute_force():
    """The core of the enumeration, configuration by configuration (counts, offloaded prefix and its unmodified
    layers, setting): whether it fits, its step, and its least error, against every placement of the layers'
    states evaluated by the cost model."""
    import itertools

    from agoq.search.milp_model import Model

    seed, rng = fresh_rng()
    checked = 0
    for trial in range(40):
        p = _problem(rng, checkpoint=True, falls=rng.random() < 0.7)
        m = Model(p)
        e = milp_offload.Enumeration.build(m)
        if e is None:
            continue
        L = p.num_layers
        is16 = p.keeps_16bit()
        sixteen = {k: int(np.nonzero((p.layer == 0) & (p.kind == k) & is16)[0][0]) - int(
            np.nonzero((p.layer == 0) & (p.kind == k))[0][0]) for k in e.kinds}
        static = float(p.static_bytes[0])
        for _ in range(3):
            budget = static + rng.uniform(0.3, 1.2) * L * e.U + 0.37
            configs = [(n_u, n_c, 0, 0, row) for n_c in range(L + 1) for n_u in range(L - n_c + 1)
                       for row in [-p.laaq_layer_seconds * n_u + (e.ckpt_seconds - p.laaq_layer_seconds) * n_c]]
            possible = e._possible(budget)
            at = {c[1:5]: i for i, c in enumerate(e.bounded())}
            for n_u, n_c, K, K_u, row in configs + list(e.configurations()):
                n_a = L - n_u - n_c
                if n_a == 0:
                    continue
                y = int(rng.randrange(len(e.B)))
                K_a = K - K_u
                # brute force: every placement of the states, the prefix holding K_u unmodified and K_a under LAAQ
                least = np.inf
                for states in set(itertools.permutations("u" * n_u + "c" * n_c + "a" * n_a)):
                    if "c" in states[:K] or states[:K].count("u") != K_u:
                        continue
                    chosen = []
                    for l, s in enumerate(states):
                        if s == "c":
                            continue
                        for j, k in enumerate(e.kinds):
                            pos = e.choice[y, j] if s == "a" else sixteen[k]
                            chosen.append(int(e.alike["index"][(l, k)][pos]))
                    ckpt = np.array([s == "c" for s in states])
                    off = np.arange(L) < K
                    f = p.evaluate(np.array(chosen, int), ckpt, off if K else None)
                    assert f["step_seconds"] - m.time_constant == pytest.approx(
                        row + float(e.link(K_u * e.U + K_a * e.B[y], K)), rel=1e-9, abs=1e-12)
                    if max(f["peak_bytes_per_stage"]) <= budget and f["host_bytes"] <= p.offload.host_budget_bytes:
                        least = min(least, f["grad_error"])
                fits = e._fits(budget, n_u, n_c, K, K_u, e.B[y:y + 1])[0] if K else \
                    e._fits_kept(budget, n_u, n_c, e.B[y:y + 1])[0]
                got = float(e.least_error(budget, n_u, n_c, K, K_u, np.array([y]))[0]) if fits else np.inf
                where = f"seed {seed} trial {trial} budget {budget} config {(n_u, n_c, K, K_u, y)}"
                if K and np.isfinite(least):  # the cheap necessary condition never rules out one that fits
                    assert possible[at[(n_u, n_c, K, K_u)]], where
                assert got == pytest.approx(least, rel=1e-9, abs=1e-12) or got == least == np.inf, where
                checked += np.isfinite(least)
    assert checked >= 20, f"seed {seed}: only {checked} configurations that fit were compared"
