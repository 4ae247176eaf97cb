"""The memory phases written once as data (agoq.search.memory_phases) against the model as it was written before
(tests/search/memory_reference.py): on random problems of one and several stages, with in-flight micro-batches,
calibration, end-of-backward bytes, LAAQ transients, floors and offloaded layers, and random choices, the phases'
evaluator gives every stage the same peak, phase, layer and side figures bit for bit, and the same memory parts in
the same order."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np

from agoq.search import memory_phases
from agoq.search.milp_rows import Rows
from tests.search.memory_reference import old_memory, old_memory_parts
from tests.search.milp_rows_reference import old_memory_matrix, old_peak_rows
from tests.search.test_milp import random_problem
from tests.search.test_milp_offload import with_offload

KEYS = ("peak", "phase", "layer", "activations", "transient", "laaq_layers", "host", "reserve", "backlog",
        "offload_floor", "checkpoint_peak", "level_at_offloaded")


def _dressed(rng, p, offload: bool):
    """`p` with the optional arrays the cost model fills (fractional bytes, so that roundings and their ties are
    exercised), the static and floor parts, and sometimes offload prices."""
    L, S = p.num_layers, p.num_stages

    def some(low, high, n):
        return np.array([rng.uniform(low, high) for _ in range(n)]) if rng.random() < 0.7 else None

    static = {"weights": p.static_bytes * 0.5, "gradients": p.static_bytes * 0.25,
              "head_and_workspace": p.static_bytes * 0.25}
    if rng.random() < 0.5:
        static["calibration"] = np.zeros(S)
    p = replace(p, unmodified_calibration=some(-20, 20, L), checkpoint_calibration=some(-5, 5, L),
                rerun_calibration=some(-10, 30, L), end_of_backward=some(-60, 40, L),
                static_parts=static, floor_parts={"weights": p.static_bytes * 0.5, "optimizer_step_workspace":
                                                  p.peak_floor() - p.static_bytes * 0.5})
    return with_offload(rng, p) if offload else p


def _choice(rng, p):
    ckpt = np.array([p.allow_checkpoint and rng.random() < 0.3 for _ in range(p.num_layers)], dtype=bool)
    chosen = [int(rng.choice(list(idx))) for (l, _k), idx in sorted(p.groups().items()) if not ckpt[l]]
    offload = None
    if p.offload is not None:
        if rng.random() < 0.5:  # a prefix, as the search offloads
            offload = (np.arange(p.num_layers) < rng.randrange(p.num_layers + 1)) & ~ckpt
        else:  # any layers: the evaluator takes them
            offload = np.array([rng.random() < 0.5 for _ in range(p.num_layers)]) & ~ckpt
    return np.array(chosen, dtype=int), ckpt, offload


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a, float), np.asarray(b, float))
    return a == b


def test_phases_evaluate_and_explain_as_the_reference_did(seed):
    rng = random.Random(seed)
    phases_seen, compared = set(), 0
    for trial in range(120):
        stages = rng.choice([1, 1, 2, 3])
        p = random_problem(rng, layers=rng.randint(stages, 5), kinds_per_layer=rng.randint(1, 4), stages=stages)
        p = _dressed(rng, p, offload=rng.random() < 0.6)
        for _ in range(8):
            chosen, ckpt, offload = _choice(rng, p)
            new, old = p._memory(chosen, ckpt, offload), old_memory(p, chosen, ckpt, offload)
            for key in KEYS:
                assert _same(new[key], old[key]), (seed, trial, key, new[key], old[key])
            entries, expected = p.memory_parts(chosen, ckpt, offload), old_memory_parts(p, chosen, ckpt, offload)
            for got, want in zip(entries, expected):
                assert list(got.items()) == list(want.items()), (seed, trial)
                assert list(got["parts"].items()) == list(want["parts"].items()), (seed, trial)
            phases_seen.update((e["phase"], "layer" in e) for e in entries)
            compared += 1
    # every phase (and offload_backward both at a layer and on the start's level) was met
    assert {"forward_backward", "backward_start", "offload_backward", "checkpoint_backward",
            "optimizer_step"} <= {phase for phase, _ in phases_seen}, phases_seen
    assert compared == 960


def test_each_phase_value_is_static_plus_its_parts(seed):
    """The explanation's parts of the winning phase add up to its value (before whole bytes), the floor's lift
    apart: the parts are the terms that make the value."""
    rng = random.Random(seed)
    for trial in range(60):
        p = _dressed(rng, random_problem(rng, layers=rng.randint(1, 4), kinds_per_layer=3), offload=True)
        chosen, ckpt, offload = _choice(rng, p)
        m = memory_phases.evaluate(p, chosen, ckpt, offload)
        for s, (phase, layer, parts, peak) in enumerate(memory_phases.explain(p, chosen, ckpt, offload)):
            winner = m["winner"][s]
            if winner is None:
                assert sum(parts.values()) == float(p.peak_floor()[s]), (seed, trial)
                continue
            value = memory_phases.phase_value(m["q"], winner, s, layer) + float(m["offload_floor"][s])
            assert abs(sum(parts.values()) - value) <= 1e-6 * max(1.0, abs(value)), (seed, trial, phase)
            assert peak == int(np.ceil(value - 1e-6)), (seed, trial, phase)


def test_milp_rows_from_the_phases_are_the_former_rows(seed):
    """The MILP's end-of-forward rows and every peak row, built from the phases (agoq.search.milp_phases), are the
    former ones (tests/search/milp_rows_reference.py) bit for bit; except, with layers offloaded and several
    micro-batches in flight, the k column (the backlog) of a checkpointed layer's row, which the former rows charged
    (f - 1)/f of and the phase (the evaluator's) does not hold."""
    rng = random.Random(seed)
    kinds = set()
    for trial in range(80):
        stages = rng.choice([1, 1, 2])
        p = random_problem(rng, layers=rng.randint(stages, 4), kinds_per_layer=rng.randint(1, 4), stages=stages)
        p = _dressed(rng, p, offload=stages == 1 and rng.random() < 0.7)
        if p.offload is not None and rng.random() < 0.7:
            p = replace(p, in_flight=np.ones(1))
        r = Rows(p)
        laaq = p.laaq_transient()
        mem = old_memory_matrix(r, laaq)
        if r.offload:
            mem[0, r.g0:r.g0 + r.L], mem[0, r.k] = -r.unit, r.unit
        old_peak_rows(r, mem, laaq)
        assert np.array_equal(r.memory_rows, mem), (seed, trial)
        assert np.array_equal(r.peak_stage, r.reference_stage), (seed, trial)
        assert np.array_equal(r.peak_offset, r.reference_offset), (seed, trial)
        got, want = r.peak_rows.copy(), r.reference_rows.copy()
        f = p.in_flight_counts()[0]
        if r.offload and p.allow_checkpoint and f > 1:
            ckpt_rows = slice(p.num_stages, p.num_stages + p.num_layers)
            assert np.array_equal(want[ckpt_rows, r.k], np.full(p.num_layers, r.unit * (f - 1) / f)), (seed, trial)
            want[ckpt_rows, r.k] = 0.0
        assert np.array_equal(got, want), (seed, trial)
        kinds.add((bool(r.offload), bool(p.allow_checkpoint)))
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}, kinds
