"""The what-if page and /api/whatif through FastAPI's TestClient: a 2-rank profile's plans at 2..16 ranks on a
network, each row the plan `agoq search --world-size N` writes, the page drawing them; bad settings refused."""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient

from agoq.cli import main
from agoq.formats.plan import load_plan
from dashboard.app import create_app
from tests.search.synthetic_profile import write_profile


@pytest.fixture
def root(tmp_path):
    rng = random.Random(random.getrandbits(32))
    write_profile(tmp_path / "root" / "prof", rng, micro_batch=2, seq_len=40, world_size=2, collectives=True,
                  fsdp_collectives=True, link_bytes_per_second=rng.uniform(2e9, 2e10))
    return tmp_path / "root"


def test_whatif_api_and_page(root, tmp_path):
    client = TestClient(create_app(root))
    params = {"id": "prof", "network": "nvlink-h100+ib-ndr400", "node_size": 4, "budget": "1GiB", "max_world": 16}
    r = client.get("/api/whatif", params=params)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["worlds"] == [2, 4, 8, 16] and data["node_size"] == 4 and data["measured_world_size"] == 2
    assert "ConnectX-7" in data["network"]["source"] and data["fit"]["rows"] > 0
    rows = {(row["world_size"], row["layout"]): row for row in data["rows"]}
    assert set(rows) == {(w, lay) for w in (2, 4, 8, 16) for lay in ("replicated", "fsdp")} | {
        (w, "hsdp") for w in (8, 16)}  # hsdp where the ranks span nodes of 4
    # a row is the plan the command writes at that size
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(root / "prof"), "--budget", "1GiB", "--out", str(out), "--quiet",
                 "--front-budgets", "0", "--world-size", "8", "--node-size", "4", "--network",
                 "nvlink-h100+ib-ndr400", "--layout", "replicated"]) == 0
    plan = load_plan(out)
    row = rows[(8, "replicated")]
    assert row["found"] and row["step_seconds"] == pytest.approx(plan.predicted.step_seconds, rel=1e-9)
    assert row["tokens_per_second"] == pytest.approx(8 * plan.decision.tokens_per_second, rel=1e-9)
    assert row["peak_bytes"] == max(plan.predicted.peak_bytes_per_stage)
    # sharded state (FSDP2): memory per rank falls with the world size, between plans of the same knobs (at a budget
    # this loose each keeps every tensor; a larger world may pick others: TLq-HS with the int4 weight gather, whose
    # buffers take back part of what sharding freed, was the plan at 16 ranks for one seed)
    fsdp = [rows[(w, "fsdp")] for w in (2, 4, 8, 16)]
    assert all(r["found"] for r in fsdp)
    same = [(a, b) for a, b in zip(fsdp, fsdp[1:]) if (a["knobs"], a["gradients"]) == (b["knobs"], b["gradients"])]
    assert all(b["peak_bytes"] < a["peak_bytes"] for a, b in same), [(r["peak_bytes"], r["knobs"]) for r in fsdp]
    assert all(rows[(w, "hsdp")]["found"] and rows[(w, "hsdp")]["knobs"]["layout"] == "hsdp" for w in (8, 16))
    page = client.get("/whatif", params=params)
    assert page.status_code == 200 and "tokens/s of the cluster" in page.text and "Not measured" in page.text
    assert f"{row['tokens_per_second']:,.0f}" in page.text
    for r in data["rows"]:  # a plan that gathers FSDP2's weights in int8 says so
        if r["found"] and r["knobs"].get("weight_gather"):
            assert f"{r['knobs']['weight_gather']} weight gather" in page.text
    assert "/whatif?id=prof" in client.get("/profile", params={"id": "prof"}).text


@pytest.mark.parametrize("params,status,words", [
    ({"id": "nothing"}, 404, "not found"),
    ({"id": "prof", "network": "token-ring", "budget": "1GiB"}, 422, "unknown network"),
    ({"id": "prof", "budget": "lots"}, 422, "budget"),
    ({"id": "prof", "budget": "1GiB", "max_world": 100000}, 422, "max_world"),
])
def test_whatif_refusals(root, params, status, words):
    client = TestClient(create_app(root))
    r = client.get("/api/whatif", params=params)
    assert r.status_code == status and words in r.text
    assert client.get("/whatif", params=params).status_code == status
