"""The plan page's memory bars are the plan's own parts (`predicted.memory_per_stage`, written by the search): for
plans of every layout and optimizer on a two-rank profile and a pipeline, saved and solved live, the bars of each
stage add up to its predicted peak and the optimizer state is the plan's optimizer's; a plan written before the
parts existed shows its peak whole; a damaged parts list is an error on the page, not a crash."""

from __future__ import annotations

import json
import math
import os
import random
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from agoq.search.costs import ProblemSettings, build_problem
from agoq.search.milp import Solver
from agoq.search.plan_builder import build_plan
from dashboard.app import create_app
from dashboard.figures import PHASE_LABELS, memory_breakdown
from tests.dashboard.test_api import snapshot
from tests.search.test_memory_parts import _profile, expected_state

KNOBS = {"ddp-adamw8bit": dict(gradient_mode="bf16", layout="replicated", optimizer="adamw8bit", master="fp32"),
         "ddp-adamw": dict(gradient_mode="quangrad8", layout="replicated", optimizer="adamw", master="fp32"),
         "fsdp-adamw8bit": dict(gradient_mode="bf16", layout="fsdp", optimizer="adamw8bit", master="none"),
         "fsdp-tlqhs": dict(gradient_mode="sdp4bit", layout="fsdp", optimizer="adamw8bit", master="fp32")}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A root with a two-rank profile (`ranks`), a pipeline profile (`pipe`) and the plans the search makes on them
    for each layout and optimizer of KNOBS (ROOT/plans/NAME.json) at a budget between the least and the roomiest."""
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    root = tmp_path_factory.mktemp("memory").resolve()
    ranks = _profile(root / "ranks", seed, True, world_size=2, collectives=True, fsdp_collectives=True,
                     micro_batch=2, seq_len=31)
    pipe = _profile(root / "pipe", seed + 1, num_layers=5, stages=2, in_flight=[3, 1], micro_batch=2, seq_len=27)
    plans = root / "plans"
    for name, knobs in [*KNOBS.items(), ("pipeline", dict(gradient_mode="bf16", optimizer="adamw8bit"))]:
        profile = pipe if name == "pipeline" else ranks
        settings = ProblemSettings(micro_batch=2, **knobs)
        problem = build_problem(profile, settings)
        solver = Solver(problem)
        low, high = solver.smallest_budget(), max(solver.solve(math.inf).peak_bytes_per_stage)
        budget = (low + high) // 2
        plan = build_plan(profile, problem, solver.solve(budget, "time"), settings, budget, "milp", "time")
        plan.save(plans / f"{name}.json")
    return root


def _bars(figure) -> dict:
    """x label -> summed height of the predicted bars there (in the figure's unit)."""
    out: dict = {}
    for trace in figure["data"]:
        if trace["type"] == "bar" and trace["name"].startswith("predicted"):
            for x, y in zip(trace["x"], trace["y"]):
                out[x] = out.get(x, 0.0) + y
    return out


def _check(memory, figure, plan, profile_memory=None):
    """The API's memory section and figure are the plan's parts, adding up to its peaks."""
    recorded = plan["predicted"]["memory_per_stage"]
    peaks = plan["predicted"]["peak_bytes_per_stage"]
    assert memory["parts_recorded"] is True and memory["predicted_peak"] == peaks
    for entry in recorded:
        s = entry["stage"]
        assert {k: v[s] for k, v in memory["predicted_parts"].items() if k in entry["parts"]} == entry["parts"]
        assert sum(v[s] or 0 for v in memory["predicted_parts"].values()) == peaks[s]
        assert memory["phases"][s] == {"phase": entry["phase"], "layer": entry.get("layer")}
    unit = figure["layout"]["yaxis"]["title"]["text"]
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    heights = list(_bars(figure).values())
    assert heights == pytest.approx([p / size for p in peaks], rel=1e-9)


def test_bars_are_the_plans_parts(root):
    before = snapshot(root)
    client = TestClient(create_app(root))
    ranks = json.loads((root / "ranks" / "profile.json").read_text())
    for name in [*KNOBS, "pipeline"]:
        plan = json.loads((root / "plans" / f"{name}.json").read_text())
        got = client.get("/api/plan", params={"id": f"plans/{name}.json"}).json()
        _check(got["memory"], memory_breakdown(got["memory"]), plan)
        if name in KNOBS:  # the plan's own optimizer, masters and shards, whatever the profile was measured with
            knobs = SimpleNamespace(**KNOBS[name])
            profile = SimpleNamespace(memory=ranks["memory"], settings=ranks["settings"])
            want = expected_state(profile, knobs, 1.0)
            for part in ("optimizer_state", "masters", "gradients", "weights"):
                assert abs(got["memory"]["predicted_parts"][part][0] - want[part]) <= 2, (name, part)
        page = client.get("/plan", params={"id": f"plans/{name}.json"})
        assert page.status_code == 200 and "peak at" in page.text
    assert snapshot(root) == before


def test_the_live_planner_draws_the_parts_it_solved(root):
    client = TestClient(create_app(root))
    found = client.get("/api/plan/range", params={"profile": "ranks"}).json()
    low, high = found["smallest_budget_bytes"], found["largest_budget_bytes"]
    for fraction in (0.0, 0.37, 1.0):
        r = client.post("/api/plan", json={"profile": "ranks", "budget": int(low + fraction * (high - low)),
                                           "error_cap": "none"})
        assert r.status_code == 200, r.text
        got = r.json()
        _check(got["view"]["memory"], got["view"]["figures"]["memory"], got["plan"])


def test_a_plan_without_parts_shows_its_peak_whole(root, tmp_path):
    plan = json.loads((root / "plans" / "pipeline.json").read_text())
    older = {**plan, "schema": "agoq.plan/1.1",
             "predicted": {k: v for k, v in plan["predicted"].items() if k != "memory_per_stage"}}
    (tmp_path / "older.json").write_text(json.dumps(older))
    damaged = json.loads(json.dumps(plan))
    damaged["predicted"]["memory_per_stage"][1]["parts"] = ["weights", 3]
    (tmp_path / "damaged.json").write_text(json.dumps(damaged))
    client = TestClient(create_app(tmp_path))
    got = client.get("/api/plan", params={"id": "older.json"}).json()["memory"]
    assert got["parts_recorded"] is False and got["predicted_parts"] == {}
    figure = memory_breakdown(got)
    assert [t["name"] for t in figure["data"]] == ["predicted peak (this plan records no parts)"]
    assert list(_bars(figure).values()) == pytest.approx(
        [p / {"B": 1, "KiB": 2**10, "MiB": 2**20}[figure["layout"]["yaxis"]["title"]["text"]]
         for p in plan["predicted"]["peak_bytes_per_stage"]])
    page = client.get("/plan", params={"id": "older.json"})
    assert page.status_code == 200 and "records no parts" in page.text
    # a plan agoq.formats refuses (as agoq train would) is refused whole, naming the file and the field
    broken = client.get("/api/plan", params={"id": "damaged.json"})
    assert broken.status_code == 422 and "damaged.json" in broken.text \
        and "predicted.memory_per_stage[1].parts" in broken.text
    assert client.get("/plan", params={"id": "damaged.json"}).status_code == 422


def test_a_negative_part_is_drawn_below_zero_with_the_peak_marked(root, tmp_path):
    """Head and workspace go negative where the calibration's credit for gradients not made yet at the peak is the
    larger: the bars still add up to the peak, and the peak is marked on each bar."""
    plan = json.loads((root / "plans" / "pipeline.json").read_text())
    parts = plan["predicted"]["memory_per_stage"][0]["parts"]
    moved = parts["head_and_workspace"] + 1000
    parts["head_and_workspace"] -= moved
    parts["activations"] += moved
    (tmp_path / "negative.json").write_text(json.dumps(plan))
    client = TestClient(create_app(tmp_path))
    memory = client.get("/api/plan", params={"id": "negative.json"}).json()["memory"]
    assert memory["predicted_parts"]["head_and_workspace"][0] == -1000
    figure = memory_breakdown(memory)
    _check(memory, figure, plan)
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20}[figure["layout"]["yaxis"]["title"]["text"]]
    marks = [t for t in figure["data"] if t["type"] == "scatter"]
    assert len(marks) == 1 and marks[0]["y"] == pytest.approx([p / size for p in plan["predicted"]["peak_bytes_per_stage"]])
    assert figure["layout"]["barmode"] == "relative"


def test_an_offloading_plan_shows_its_host_memory_beside_the_gpu(root, tmp_path):
    """A plan that keeps layers' saved tensors in host memory (schema 1.4) draws that second place beside its GPU
    bars, at its predicted host bytes; its GPU bars still add up to its peak; a plan that offloads nothing has no
    host bar."""
    plan = json.loads((root / "plans" / "ddp-adamw8bit.json").read_text())
    rng = random.Random()
    host = rng.randrange(10**6, 10**9)
    k = rng.randrange(1, len(plan["layers"]) + 1)
    for lp in plan["layers"][:k]:
        lp["offload"] = True
    plan["schema"], plan["predicted"]["host_bytes"] = "agoq.plan/1.5", host
    (tmp_path / "offload.json").write_text(json.dumps(plan))
    (tmp_path / "plain.json").write_text((root / "plans" / "ddp-adamw8bit.json").read_text())
    client = TestClient(create_app(tmp_path))
    memory = client.get("/api/plan", params={"id": "offload.json"}).json()["memory"]
    assert memory["host_bytes"] == host and memory["offloaded_layers"] == list(range(k))
    figure = memory_breakdown(memory)
    _check(memory, figure, plan)
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[figure["layout"]["yaxis"]["title"]["text"]]
    bars = [t for t in figure["data"] if t["name"].startswith("host")]
    assert len(bars) == 1 and bars[0]["y"] == pytest.approx([host / size])
    assert f"{k} offloaded layer" in bars[0]["x"][0]
    assert client.get("/plan", params={"id": "offload.json"}).status_code == 200
    plain = memory_breakdown(client.get("/api/plan", params={"id": "plain.json"}).json()["memory"])
    assert not [t for t in plain["data"] if t["name"].startswith("host")]


def _served_labels(folder, plan: dict):
    """`plan` written into `folder` and served: its memory figure (checked against the plan) and the figure's labels."""
    (folder / "served.json").write_text(json.dumps(plan))
    memory = TestClient(create_app(folder)).get("/api/plan", params={"id": "served.json"}).json()["memory"]
    figure = memory_breakdown(memory)
    _check(memory, figure, plan)
    return figure, {x for t in figure["data"] for x in t.get("x", [])}


def test_a_peak_at_the_start_of_backward_is_named_so(root, tmp_path):
    """A stage whose predicted peak is set at the start of backward (schema 1.5: with offloaded layers, backward's
    first prefetch in flight) is labelled so under its bar, and its parts still add up to its peak."""
    plan = json.loads((root / "plans" / "ddp-adamw8bit.json").read_text())
    stage = random.randrange(len(plan["predicted"]["memory_per_stage"]))
    plan["schema"] = "agoq.plan/1.5"
    plan["predicted"]["memory_per_stage"][stage]["phase"] = "backward_start"
    figure, labels = _served_labels(tmp_path, plan)
    assert f"stage {stage}: predicted (start of backward (first prefetch))" in labels
    from agoq.search.memory_parts import PHASE_NAMES  # the dashboard's words are the search's

    assert PHASE_LABELS == PHASE_NAMES


def test_a_peak_in_an_offloaded_layers_backward_is_named_so(root, tmp_path):
    """A stage whose predicted peak is set in the backward of an offloaded layer (schema 1.7, phase offload_backward)
    is labelled with that layer, or without one (the allocation on top of the start of backward) as the phase; its
    part `offload_backward` is drawn like any other and the parts still add up to the peak."""
    plan = json.loads((root / "plans" / "ddp-adamw8bit.json").read_text())
    stage = random.randrange(len(plan["predicted"]["memory_per_stage"]))
    entry = plan["predicted"]["memory_per_stage"][stage]
    name = next(iter(entry["parts"]))
    moved = random.randrange(1, max(2, entry["parts"][name]))
    entry["parts"][name] -= moved
    entry["parts"]["offload_backward"] = moved  # the same peak, one more part
    plan["schema"] = "agoq.plan/1.7"
    layer = random.choice([0, 1, None])
    entry["phase"] = "offload_backward"
    if layer is not None:
        entry["layer"] = layer
    figure, labels = _served_labels(tmp_path, plan)
    said = f"backward of offloaded layer {layer}" if layer is not None else "backward of an offloaded layer"
    assert f"stage {stage}: predicted ({said})" in labels
    assert [t for t in figure["data"] if t["name"] == "predicted offload backward"], [t["name"] for t in figure["data"]]
