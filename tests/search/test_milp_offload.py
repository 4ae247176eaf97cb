"""Offload in the MILP against brute force: with a host link priced (ChoiceProblem.offload), every choice of
options, checkpointed layers and offloaded prefix is evaluated by the cost model's own `evaluate`, and the MILP
finds the same least step time at every budget, within the host budget; its plan's layers say which are offloaded."""

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from agoq.search.milp import InfeasibleBudget, Solver
from agoq.search.problem import OffloadPrices
from tests.search.test_milp import random_problem


def fresh_rng():
    seed = random.getrandbits(32)
    return seed, random.Random(seed)


def with_offload(rng, p):
    """`p` with random offload prices: a link whose time per byte makes some offloads exposed, a window, a slowdown
    and a host budget that sometimes binds."""
    bytes_per_layer = float(np.max(p.memory)) * 4
    link = rng.uniform(0.2, 2.0) / bytes_per_layer  # seconds per byte, out and back
    return replace(p, offload=OffloadPrices(link_seconds_per_byte=link, window_seconds=rng.uniform(0.0, 1.5),
                                            seconds_per_byte=rng.uniform(0.0, 0.3) * link,
                                            host_budget_bytes=rng.uniform(0.5, 3.0) * bytes_per_layer,
                                            grad_accum=rng.choice([1, 2])))


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
            if f["host_bytes"] > p.offload.host_budget_bytes + 1:
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
        for budget in (low, rng.uniform(low, high), rng.uniform(low, high), high):
            fits = [(f, off) for f, off in everything if max(f["peak_bytes_per_stage"]) <= budget]
            if not fits:
                with pytest.raises(InfeasibleBudget):
                    solver.solve(budget, "time")
                continue
            best = min(f["step_seconds"] for f, _ in fits)
            alloc = solver.solve(budget, "time")
            where = f"seed {seed} trial {trial} budget {budget}"
            assert alloc.step_seconds == pytest.approx(best, rel=1e-6, abs=1e-9), where
            assert max(alloc.peak_bytes_per_stage) <= budget + 1, where
            assert alloc.host_bytes <= p.offload.host_budget_bytes + 1, where
            off = alloc.offloaded()
            k = int(off.sum())
            assert off[:k].all() and not (off & alloc.checkpoint).any(), where  # a prefix, none checkpointed
            settings = alloc.settings(p)
            assert [bool(s.get("offload")) for s in settings] == list(off), where
            # the figures the allocation carries are the cost model's own for its choice
            f = p.evaluate(alloc.chosen, alloc.checkpoint, off)
            assert f["host_bytes"] == alloc.host_bytes and f["step_seconds"] == pytest.approx(alloc.step_seconds)


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
    """The step time of an offload is the exposed link time (x accumulation) plus the slowdown per byte: a closed
    form checked on the cost model."""
    seed, rng = fresh_rng()
    p = with_offload(rng, random_problem(rng, layers=4, kinds_per_layer=2, stages=1))
    sixteen = np.nonzero(p.keeps_16bit())[0]
    none = np.zeros(4, dtype=bool)
    base = p.evaluate(sixteen, none)
    off = np.array([True, True, False, False])
    f = p.evaluate(sixteen, none, off)
    o = p.offload
    host = f["host_bytes"]
    assert host > 0
    expected = o.grad_accum * max(0.0, host * o.link_seconds_per_byte - o.window_seconds) + host * o.seconds_per_byte
    assert f["step_seconds"] - base["step_seconds"] == pytest.approx(expected, rel=1e-9, abs=1e-12), f"seed {seed}"
    assert f["offload_link_seconds"] == pytest.approx(host * o.link_seconds_per_byte)
