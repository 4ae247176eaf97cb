"""50 concurrent plan requests over loopback against a real uvicorn server: every one ends in a 200 whose plan
fits its budget (a 503 is retried after its Retry-After), the same budget gets the same plan, the plans are
the search's own, and the server answers afterwards. Prints the p95 latency."""

from __future__ import annotations

import random


from agoq.formats.profile import load_profile
from agoq.search.search import search
from dashboard.app import create_app
from dashboard.planner import Planner
from experiments.service_load import request, run_load, serve, spread
from tests.search.synthetic_profile import write_profile


def test_fifty_concurrent_plans(tmp_path, capsys, seed):
    write_profile(tmp_path / "prof", random.Random(seed), micro_batch=3, seq_len=37)
    planner = Planner(workers=2, queue=4, timeout=40)
    with serve(create_app(tmp_path, planner=planner)) as (host, port):
        status, _, found = request(host, port, "GET", "/api/plan/range?profile=prof")
        assert status == 200, found
        budgets = spread(found["smallest_budget_bytes"], found["largest_budget_bytes"], 9)
        figures = run_load(host, port, "prof", budgets, 50, deadline_s=45)
        assert figures["failures"] == []
        assert figures["answered_200"] == 50 and figures["server_up_after"]
        assert planner.solves == len(budgets) + 1  # the range, then one solve per budget shared by its requests
        profile = load_profile(tmp_path / "prof")
        for budget in budgets[::4]:  # spot checks against the search itself
            status, _, body = request(host, port, "POST", "/api/plan", {"profile": "prof", "budget": budget})
            assert status == 200 and body["cached"] is True
            want = search(profile, budget, front_budgets=0, progress=False).plan.to_dict()
            assert body["plan"]["layers"] == want["layers"] and body["plan"]["predicted"] == want["predicted"]
    planner.close()
    latency = figures["latency_seconds"]
    with capsys.disabled():
        print(f"\nplan load: 50 requests, {len(budgets)} budgets, {figures['retried_503']} 503s retried, "
              f"p50 {latency['p50']:.2f} s, p95 {latency['p95']:.2f} s, max {latency['max']:.2f} s, "
              f"wall {figures['wall_seconds']:.1f} s")
    assert figures["wall_seconds"] < 50
