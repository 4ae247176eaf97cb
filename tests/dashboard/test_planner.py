"""The live planner (POST /api/plan, /api/plan/range, /api/plan/save): its plans are the ones `agoq search`
writes for the same budget, bad input is a 4xx that says what to do, a full pool is a 503 with Retry-After,
a slow solve a 504, and saving writes only a plain file name under ROOT/plans/, never over a file unasked,
and from another machine only with the token."""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from agoq.cli import main
from agoq.formats.profile import load_profile
from agoq.search.costs import build_problem
from agoq.search.knobs import budget_bounds, combinations
from agoq.search.milp import Solver
from dashboard import planner as planner_module
from dashboard.app import create_app
from dashboard.planner import Planner
from tests.dashboard import synthetic
from tests.dashboard.test_api import snapshot
from tests.search.synthetic_profile import write_profile

LOOPBACK = ("127.0.0.1", 40123)


@pytest.fixture(scope="module")
def plan_root(tmp_path_factory, named_seed) -> Path:
    """A root with a profile the search reads (`prof`, micro-batch 3 x 37 tokens) and one it cannot (`odd`:
    the dashboard's synthetic profile, which offers recompute for kinds that cannot be recomputed)."""
    seed = named_seed("plan_root")
    root = tmp_path_factory.mktemp("planner").resolve()
    write_profile(root / "prof", random.Random(seed), micro_batch=3, seq_len=37)
    synthetic.write_profile(root / "odd", np.random.default_rng(seed), 3, "0123456789abcdef")
    return root


@pytest.fixture(scope="module")
def bounds(plan_root) -> tuple[int, int]:
    """(smallest budget any plan fits, largest peak of a plan keeping everything), bytes, over the search's
    knobs: the least of each combination's solver, checked here by brute force over the combinations."""
    profile = load_profile(plan_root / "prof")
    solvers = [Solver(build_problem(profile, knobs)) for knobs in combinations(profile)]
    smallest = min(s.smallest_budget() for s in solvers)
    largest = max(math.ceil(max(s.solve(math.inf).peak_bytes_per_stage)) for s in solvers)
    assert budget_bounds(profile) == (smallest, largest)
    return smallest, largest


def cli_plan(profile: Path, budget: int, out: Path, *extra: str) -> dict:
    """The plan `agoq search` writes for `budget` (run in-process)."""
    assert main(["search", "--profile", str(profile), "--budget", str(budget), "--out", str(out), "--quiet",
                 "--front-budgets", "0", *extra]) == 0
    return json.loads(out.read_text())


def undated(plan: dict) -> dict:
    """A plan without the time it was made."""
    return {**plan, "source": {k: v for k, v in plan["source"].items() if k != "date"}}


def test_plans_are_the_searchs(plan_root, bounds, tmp_path):
    low, high = bounds
    before = snapshot(plan_root)
    client = TestClient(create_app(plan_root))
    found = client.get("/api/plan/range", params={"profile": "prof"}).json()
    assert (found["smallest_budget_bytes"], found["largest_budget_bytes"]) == (low, math.ceil(high))
    import argparse

    from agoq.commands import search as search_command

    parser = argparse.ArgumentParser()
    search_command.configure(parser)
    for name in ("objective", "time_cap", "error_cap"):  # the command's defaults, whatever they are now
        assert found["defaults"][name] == parser.get_default(name)
    settings = json.loads((plan_root / "prof" / "profile.json").read_text())["settings"]
    for i, (fraction, extra) in enumerate([(0.23, ()), (0.61, ()), (0.47, ("--objective", "time", "--error-cap",
                                                                           "recipe"))]):
        budget = int(low + fraction * (high - low)) + 11
        body = {"profile": "prof", "budget": budget}
        if extra:
            body.update(objective="time", error_cap="recipe")
        r = client.post("/api/plan", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        want = cli_plan(plan_root / "prof", budget, tmp_path / f"cli{i}" / "plan.json", *extra)
        assert undated(got["plan"]) == undated(want)
        assert got["budget_bytes"] == budget and got["predicted"]["peak_bytes"] <= budget
        assert got["predicted"]["peak_bytes"] == max(want["predicted"]["peak_bytes_per_stage"])
        step = want["predicted"]["step_seconds"]
        assert got["predicted"]["tokens_per_second"] == pytest.approx(3 * 37 * settings.get("grad_accum", 1) / step)
        assert got["caps"]["objective"] == ("time" if extra else parser.get_default("objective"))
        # the view is the plan page's: bits per layer and kind, memory per stage
        layers = sorted(want["layers"], key=lambda e: e["layer"])
        for entry, row in zip(layers, got["view"]["bits"]["bits"]):
            for kind, value in zip(got["view"]["bits"]["kinds"], row):
                setting = entry["kinds"][kind]
                assert value == (-1 if entry["checkpoint"] else 0 if setting == "recompute" else setting)
        assert got["view"]["memory"]["predicted_peak"] == want["predicted"]["peak_bytes_per_stage"]
        again = client.post("/api/plan", json=body).json()
        assert again["cached"] is True and again["plan"] == got["plan"]
    # a size as the command reads it
    mib = (low + 0.52 * (high - low)) / 2**20
    r = client.post("/api/plan", json={"profile": "prof", "budget": f"{mib:.4f}MiB"})
    assert r.status_code == 200 and r.json()["budget_bytes"] == int(round(float(f"{mib:.4f}") * 2**20))
    assert snapshot(plan_root) == before  # solving writes nothing


def test_bad_input_is_a_4xx_that_says_why(plan_root, bounds):
    low, high = bounds
    client = TestClient(create_app(plan_root))
    post = lambda **body: client.post("/api/plan", json={"profile": "prof", **body})  # noqa: E731
    assert client.post("/api/plan", json={"profile": "no/such", "budget": low}).status_code == 404
    for budget, words in [(-5, "more than 0"), (0, "more than 0"), ("-3GiB", "more than 0"), ("lots", "cannot read"),
                          (2**51, "more than any GPU"), ("3000TiB", "more than any GPU"), (float("nan"), None),
                          (True, None), (None, None), ([1], None)]:
        r = post(budget=budget) if not (isinstance(budget, float) and math.isnan(budget)) else \
            client.post("/api/plan", content='{"profile": "prof", "budget": NaN}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 422, (budget, r.text)
        if words:
            assert words in r.json()["detail"], (budget, r.text)
    for caps, words in [({"objective": "fastest"}, "invalid choice"), ({"time_cap": -0.5}, "> 0"),
                        ({"error_cap": "tiny"}, "recipe"), ({"layout": "diagonal"}, "layout: invalid choice"),
                        ({"gradients": 8}, "field gradients"), ({"budgets": 3}, "field budgets is not one")]:
        r = post(budget=high, **caps)
        assert r.status_code == 422 and words in json.dumps(r.json()), (caps, r.text)
    # below the smallest budget any plan fits: 422 naming the smallest under the request's caps (the default
    # error cap may ask for more); at it, a plan; a byte less, none
    r = post(budget=low - 1)
    assert r.status_code == 422
    least = r.json()["detail"]["smallest_budget_bytes"]
    assert least >= low and str(least) in r.json()["detail"]["message"]
    assert post(budget=least).status_code == 200
    r = post(budget=least - 1).json()["detail"]
    assert r["smallest_budget_bytes"] == least
    asked, smallest = re.search(r"fits a budget of (.+?) per .* budget is (.+?) \(", r["message"]).groups()
    assert asked != smallest, r["message"]  # a byte apart, and said so
    # a time cap no plan meets at any budget: 422 without a budget
    r = post(budget=high, time_cap=1e-9)
    assert r.status_code == 422 and r.json()["detail"]["smallest_budget_bytes"] is None
    assert "raise time_cap" in r.json()["detail"]["message"]  # the JSON field, not the command's flag
    assert "--" not in r.json()["detail"]["message"]
    # a profile the search cannot read: the range says why (200, for its page), a plan is a 422
    assert "recompute" in client.get("/api/plan/range", params={"profile": "odd"}).json()["error"]
    r = client.post("/api/plan", json={"profile": "odd", "budget": 10**9})
    assert r.status_code == 422 and "cannot be recomputed" in r.json()["detail"]
    assert client.get("/api/plan/range", params={"profile": "nope"}).status_code == 404


@pytest.fixture()
def blocked(monkeypatch):
    """plan_at_budget replaced by one that waits until the test releases it; yields the release event."""
    release = threading.Event()
    real = planner_module.plan_at_budget

    def slow(entry, query):
        assert release.wait(30), "the test never released the solve"
        return real(entry, query)

    monkeypatch.setattr(planner_module, "plan_at_budget", slow)
    yield release
    release.set()


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_full_queue_is_503_with_retry_after(plan_root, bounds, blocked):
    low, high = bounds
    planner = Planner(workers=1, queue=1, timeout=30)
    client = TestClient(create_app(plan_root, planner=planner))
    budgets = [int(low + f * (high - low)) for f in (0.31, 0.57, 0.83)]
    answers: dict[int, int] = {}
    threads = []
    for n, budget in enumerate(budgets[:2]):
        t = threading.Thread(target=lambda b=budget: answers.update(
            {b: client.post("/api/plan", json={"profile": "prof", "budget": b}).status_code}))
        t.start()
        threads.append(t)
        wait_for(lambda n=n: planner.status()["in_flight"] == n + 1)  # one solving, then one waiting
    r = client.post("/api/plan", json={"profile": "prof", "budget": budgets[2]})
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1 and "busy" in r.json()["detail"] and "ask again" in r.json()["detail"]
    same = threading.Thread(target=lambda: answers.update(
        {"same": client.post("/api/plan", json={"profile": "prof", "budget": budgets[0]}).status_code}))
    same.start()  # the same question as one in flight shares its solve instead of being refused
    time.sleep(0.2)
    assert planner.status()["in_flight"] == 2
    blocked.set()
    for t in threads + [same]:
        t.join(30)
    assert answers == {budgets[0]: 200, budgets[1]: 200, "same": 200}
    assert planner.solves == 2
    assert client.post("/api/plan", json={"profile": "prof", "budget": budgets[2]}).status_code == 200


def test_slow_solve_is_504_and_kept(plan_root, bounds, blocked):
    low, high = bounds
    planner = Planner(workers=1, queue=0, timeout=0.3)
    client = TestClient(create_app(plan_root, planner=planner))
    budget = int(low + 0.44 * (high - low))
    r = client.post("/api/plan", json={"profile": "prof", "budget": budget})
    assert r.status_code == 504 and "longer than 0.3 s" in r.json()["detail"]
    blocked.set()
    wait_for(lambda: planner.status()["in_flight"] == 0)
    again = client.post("/api/plan", json={"profile": "prof", "budget": budget})
    assert again.status_code == 200 and again.json()["cached"] is True


def test_a_rewritten_profile_is_read_again(plan_root, bounds, tmp_path):
    import shutil

    low, high = bounds
    shutil.copytree(plan_root / "prof", tmp_path / "prof")
    planner = Planner()
    client = TestClient(create_app(tmp_path, planner=planner))
    body = {"profile": "prof", "budget": int(low + 0.5 * (high - low))}
    first = client.post("/api/plan", json=body).json()
    assert client.post("/api/plan", json=body).json()["cached"] and planner.solves == 1
    write_profile(tmp_path / "prof", random.Random(99), micro_batch=3, seq_len=37)  # new sensitivities and times
    os.utime(tmp_path / "prof" / "profile.parquet", ns=(1, time.time_ns() + 10**9))
    second = client.post("/api/plan", json=body).json()
    assert second["cached"] is False and planner.solves == 2
    want = cli_plan(tmp_path / "prof", body["budget"], tmp_path / "cli" / "plan.json")
    assert undated(second["plan"]) == undated(want)
    assert first["plan"]["source"]["profile"] == second["plan"]["source"]["profile"]


# --- saving ------------------------------------------------------------------------------------------

def test_save_writes_the_searchs_plan_once(plan_root, bounds, tmp_path):
    import shutil

    low, high = bounds
    root = tmp_path / "root"
    shutil.copytree(plan_root / "prof", root / "prof")
    root = root.resolve()
    client = TestClient(create_app(root), client=LOOPBACK)
    budget = int(low + 0.38 * (high - low)) + 5
    before = snapshot(root)
    r = client.post("/api/plan/save", json={"profile": "prof", "budget": budget, "name": "tight-plan"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "plans/tight-plan.json" and r.json()["overwritten"] is False
    saved = root / "plans" / "tight-plan.json"
    want = cli_plan(root / "prof", budget, tmp_path / "cli" / "plan.json")
    assert undated(json.loads(saved.read_text())) == undated(want)
    assert saved.read_text().endswith("}\n")  # written as `agoq search` writes a plan
    assert set(snapshot(root)) - set(before) == {"plans", "plans/tight-plan.json"}  # nothing else, no temp file
    assert "plans/tight-plan.json" in [p["id"] for p in client.get("/api/index").json()["plans"]]
    # an existing file is not replaced unless asked
    other = int(low + 0.9 * (high - low))
    content = saved.read_bytes()
    r = client.post("/api/plan/save", json={"profile": "prof", "budget": other, "name": "tight-plan.json"})
    assert r.status_code == 409 and "exists" in r.json()["detail"] and saved.read_bytes() == content
    r = client.post("/api/plan/save", json={"profile": "prof", "budget": other, "name": "tight-plan.json",
                                            "overwrite": True})
    assert r.status_code == 200 and r.json()["overwritten"] is True
    assert json.loads(saved.read_text())["budget_bytes"] == other


def test_save_refuses_traversal_and_other_sites(plan_root, bounds, tmp_path):
    low, high = bounds
    import shutil

    root = tmp_path / "root"
    shutil.copytree(plan_root / "prof", root / "prof")
    client = TestClient(create_app(root), client=LOOPBACK)
    budget = int(low + 0.5 * (high - low))
    before = snapshot(tmp_path)
    for name in ["../escape.json", "../../escape", "a/b.json", "/tmp/abs.json", ".hidden.json", "..", "x\\y.json",
                 "", "plan\x00.json", "a" * 200, "~user.json", "name with spaces.json", "..json"]:
        r = client.post("/api/plan/save", json={"profile": "prof", "budget": budget, "name": name})
        assert r.status_code == 422 and "plain file name" in r.json()["detail"], (name, r.text)
    r = client.post("/api/plan/save", content=json.dumps({"profile": "prof", "budget": budget, "name": "p"}),
                    headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text  # not JSON: a form another site could post is refused
    r = client.post("/api/plan/save", json={"profile": "prof", "budget": budget, "name": "p"},
                    headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    assert snapshot(tmp_path) == before
    # ROOT/plans leading out of the root is not written through
    (tmp_path / "outside").mkdir()
    (root / "plans").symlink_to(tmp_path / "outside", target_is_directory=True)
    r = client.post("/api/plan/save", json={"profile": "prof", "budget": budget, "name": "p"})
    assert r.status_code == 422 and list((tmp_path / "outside").iterdir()) == []


def test_save_needs_the_token_off_loopback(plan_root, bounds, tmp_path):
    import shutil

    low, high = bounds
    root = tmp_path / "root"
    shutil.copytree(plan_root / "prof", root / "prof")
    body = {"profile": "prof", "budget": int(low + 0.7 * (high - low)), "name": "remote"}
    remote = TestClient(create_app(root), client=("192.0.2.7", 50000))
    r = remote.post("/api/plan/save", json=body)
    assert r.status_code == 403 and "token" in r.json()["detail"]
    assert remote.post("/api/plan", json={k: v for k, v in body.items() if k != "name"}).status_code == 200
    assert not (root / "plans").exists()
    guarded = TestClient(create_app(root, token="plan-token-42"), client=("192.0.2.7", 50000))
    assert guarded.post("/api/plan/save", json=body).status_code == 401
    r = guarded.post("/api/plan/save", json=body, headers={"x-agoq-token": "plan-token-42"})
    assert r.status_code == 200 and (root / "plans" / "remote.json").is_file()
