"""The least peak within caps (agoq.search.milp_least) and the least budget over several problems
(agoq.search.knobs.least_budget) against brute force: every choice of options, checkpointed layers and offloaded
prefix evaluated by the cost model's own `evaluate`."""

import random
from dataclasses import replace

import numpy as np
import pytest

from agoq.search.knobs import least_budget
from agoq.search.milp import Solver
from tests.search.test_milp import brute_force as kept_brute_force
from tests.search.test_milp import random_problem
from tests.search.test_milp_offload import brute_force as offload_brute_force
from tests.search.test_milp_offload import with_offload


def _problem(rng):
    """A random problem, with a host link priced 60 % of the time (one stage), else of one or two pipeline stages
    (the least peak is the largest stage's), and every choice's figures."""
    if rng.random() < 0.6:
        p = random_problem(rng, layers=3, kinds_per_layer=2, stages=1)
        p = replace(with_offload(rng, p), in_flight=np.ones(1))
        return p, [f for f, _ in offload_brute_force(p)]
    p = random_problem(rng, layers=3, kinds_per_layer=2, stages=rng.choice([1, 2]))
    return p, [f for _, f in kept_brute_force(p)]


def _caps(rng, everything):
    """A random error cap and time cap (each sometimes none) that some choice meets, or, now and then, none does."""
    errors = sorted(f["grad_error"] for f in everything)
    times = sorted(f["step_seconds"] for f in everything)
    error_cap = rng.choice([None, errors[len(errors) // 3] * rng.uniform(0.9, 1.5), errors[0] * 0.5 - 1e-3])
    time_cap = rng.choice([None, times[len(times) // 2] * rng.uniform(1.0, 1.2)])
    return time_cap, error_cap


def _least(everything, time_cap, error_cap):
    fits = [max(f["peak_bytes_per_stage"]) for f in everything
            if (time_cap is None or f["step_seconds"] <= time_cap * (1 + 1e-9))
            and (error_cap is None or f["grad_error"] <= error_cap * (1 + 1e-9))]
    return min(fits) if fits else None


def test_the_least_peak_within_caps_is_brute_forces_and_below_asks_for_less(seed):
    rng = random.Random(seed)
    for trial in range(6):
        p, everything = _problem(rng)
        time_cap, error_cap = _caps(rng, everything)
        true = _least(everything, time_cap, error_cap)
        solver = Solver(p)
        where = f"seed {seed} trial {trial} offload {p.offload is not None} caps {time_cap} {error_cap}"
        alloc = solver.least_memory(time_cap, error_cap)
        for by_prefix in (False, True):
            bound = solver.least_memory_bound(time_cap, error_cap, by_prefix=by_prefix)
            if true is None:
                assert alloc is None, where
                continue
            assert bound is not None and bound <= true * (1 + 1e-7) + 1, where  # a lower bound
        if true is None:
            continue
        assert alloc is not None and max(alloc.peak_bytes_per_stage) == pytest.approx(true, abs=1), where
        assert error_cap is None or alloc.grad_error <= error_cap * (1 + 1e-7), where
        assert time_cap is None or alloc.step_seconds <= time_cap * (1 + 1e-7) + 1e-9, where
        # asked only for a choice under a budget: the least one where it is under, none where the least is not
        above = true + rng.uniform(0.01, 0.5) * true
        under = solver.least_memory(time_cap, error_cap, below=above)
        assert under is not None and max(under.peak_bytes_per_stage) == pytest.approx(true, abs=1), where
        assert solver.least_memory(time_cap, error_cap, below=true - 1) is None, where
        assert solver.least_memory(time_cap, error_cap, below=true * rng.uniform(0.3, 0.99)) is None, where


@pytest.mark.parametrize("quick_finds", [True, False])
def test_the_least_budget_over_problems_is_the_least_of_their_least_peaks(seed, monkeypatch, quick_finds):
    """Best bound first, a quick pass, then an exact one under the least found; `quick_finds` False: the quick
    pass's time limit comes before any choice each time (as on a loaded machine), and the exact pass finds it all."""
    rng = random.Random(seed)
    if not quick_finds:
        real = Solver.least_memory

        def slow(self, *args, patient=True, **kwargs):
            return None if not patient else real(self, *args, **kwargs)

        monkeypatch.setattr(Solver, "least_memory", slow)
    for trial in range(5):
        problems = [_problem(rng) for _ in range(rng.randint(2, 6))]
        _, error_cap = _caps(rng, problems[0][1])
        time_caps = [_caps(rng, everything)[0] for _, everything in problems]
        truths = [_least(everything, t, error_cap) for (_, everything), t in zip(problems, time_caps)]
        least, who = least_budget([(Solver(p), t) for (p, _), t in zip(problems, time_caps)], error_cap)
        where = f"seed {seed} trial {trial} truths {truths}"
        known = [t for t in truths if t is not None]
        if not known:
            assert (least, who) == (None, None), where
            continue
        assert least == pytest.approx(min(known), abs=1), where
        assert truths[who] == pytest.approx(least, abs=1), where  # the one named fits it
