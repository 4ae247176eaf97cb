"""A compiled plan's compile cost: how many layer graphs torch.compile builds for it (one per distinct layer
setting) and the seconds they take, priced from the profile's first compiled steps; eager plans compile nothing."""

from __future__ import annotations

import json
import random

import pytest

from agoq.formats.profile import load_profile
from agoq.search.knobs import budget_bounds
from agoq.search.plan_builder import compile_cost
from agoq.search.request import KnobSpace
from agoq.search.search import search
from tests.search.synthetic_profile import write_profile


def _profile(tmp_path, rng):
    """A 5-layer profile measured eager and compiled, each compiled step with a first (compiling) step of its own."""
    folder = write_profile(tmp_path / "p", rng, num_layers=5, micro_batch=2, seq_len=29,
                           compile_modes=("eager", "compiled"))
    header = json.loads((folder / "profile.json").read_text())
    for row in header["measured_steps"]["rows"]:
        row["first_step_seconds"] = row["step_seconds"] + (rng.uniform(1, 20) if row["compile"] == "compiled"
                                                           else rng.uniform(0, 1))
    (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder), header["measured_steps"]["rows"]


def _reference(rows, layers, compile_mode):
    """Brute force: the distinct layer settings, and each policy's longest first compiled step less its step."""
    if compile_mode != "compiled":
        return 0, 0.0
    price = {}
    for r in rows:
        if r["compile"] == "compiled" and r["activation_memory_budget"] is None:
            price[r["policy"]] = max(price.get(r["policy"], 0.0), r["first_step_seconds"] - r["step_seconds"])
    settings = {json.dumps([bool(lp["checkpoint"]), {} if lp["checkpoint"] else
                            {k: v for k, v in lp["kinds"].items() if v != 16}], sort_keys=True) for lp in layers}
    seconds = price["bf16"]
    for s in settings:
        checkpoint, kinds = json.loads(s)
        seconds += price["checkpoint-all"] if checkpoint else price["agoq-paper"] if kinds else 0.0
    return len(settings), seconds


@pytest.mark.parametrize("compile_mode", ["compiled", "eager"])
def test_plans_carry_their_compile_cost(tmp_path, compile_mode):
    seed = random.getrandbits(32)
    rng = random.Random(seed)
    profile, rows = _profile(tmp_path, rng)
    least, largest = budget_bounds(profile)
    for budget in sorted({least, int(rng.uniform(least, largest)), largest}):
        plan = search(profile, budget, method="milp", front_budgets=0, validate=0, progress=False,
                      space=KnobSpace(compile_modes=(compile_mode,)), error_cap=None).plan
        layers = [lp.model_dump(mode="json") for lp in plan.layers]
        graphs, seconds = _reference(rows, layers, plan.training.compile)
        assert plan.predicted.compile_graphs == graphs, (seed, budget)
        assert plan.predicted.compile_seconds == pytest.approx(seconds, rel=1e-12), (seed, budget)


def test_a_profile_without_first_steps_prices_no_compile_time(tmp_path):
    rng = random.Random(random.getrandbits(32))
    profile, _ = _profile(tmp_path, rng)
    for row in profile.header["measured_steps"]["rows"]:
        row.pop("first_step_seconds")
    profile.cache.clear()
    layers = [{"layer": 0, "checkpoint": False, "kinds": {"attention": 4}},
              {"layer": 1, "checkpoint": True, "kinds": {}}]
    assert compile_cost(profile, layers, "compiled") == (2, None)
    assert compile_cost(profile, layers, "eager") == (0, 0.0)
