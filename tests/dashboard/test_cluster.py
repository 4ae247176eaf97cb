"""A cluster plan in the dashboard (dashboard.cluster) through FastAPI's TestClient: the layout as dimensions and the
data ranks on the overview (ddp, fsdp, a what-if's nodes; hsdp from its parallel section), and the plan
page's layout steps beside their prices, checked against the one price computed here."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from fastapi.testclient import TestClient

from agoq.cli import main
from agoq.formats.profile import load_profile
from agoq.parallel_dims import plan_dims
from agoq.search.price import Configuration, price
from agoq.search.problem import ProblemSettings
from dashboard import cluster
from dashboard.app import create_app
from dashboard.markup import fmt_seconds
from tests.search.synthetic_profile import write_profile
from tests.search.test_whatif_cluster import _with_layout_steps

SEARCHES = {"ddp": ("replicated", "bf16"), "tlq": ("fsdp", "sdp4bit"), "fsdp": ("fsdp", "bf16")}


@pytest.fixture(scope="module")
def root(tmp_path_factory, named_seed):
    rng = random.Random(named_seed("cluster_root"))
    root = tmp_path_factory.mktemp("cluster")
    prof = write_profile(root / "prof", rng, num_layers=3, micro_batch=3, seq_len=37, world_size=2, collectives=True,
                         fsdp_collectives=True, link_bytes_per_second=rng.uniform(3e8, 3e9), layer_forward=True,
                         compile_modes=("eager",), step_peaks=True, optimizer_step_bytes=rng.randrange(10**5, 10**6))
    _with_layout_steps(prof, rng, "eager")
    write_profile(root / "one", rng, num_layers=3, micro_batch=3, seq_len=37, layer_forward=True)

    def search(profile, name, *extra):
        assert main(["search", "--profile", str(profile), "--budget", "1TB", "--out", str(root / name / "plan.json"),
                     "--quiet", "--front-budgets", "0", *extra]) == 0

    for name, (layout, gradients) in SEARCHES.items():
        search(prof, name, "--layout", layout, "--gradients", gradients)
    node = rng.choice([2, 4])
    search(prof, "whatif", "--world-size", str(4 * node), "--node-size", str(node), "--network", "nvlink-h100+roce-100g")
    search(root / "one", "single")
    return root


def _plan(root, name):
    return json.loads((root / name / "plan.json").read_text())


def test_overview_counts_data_ranks_per_layout(root, capsys):
    client = TestClient(create_app(root))
    plans = {p["id"].split("/")[0]: p for p in client.get("/api/index").json()["plans"]}
    assert set(plans) == {*SEARCHES, "whatif", "single"}
    for name, entry in plans.items():
        plan = _plan(root, name)
        dims = plan_dims(plan)  # the plan's own rules, apart from the dashboard's reading of the section
        lay = entry["layout"]
        assert (lay["data_ranks"], lay["world_size"]) == (dims.data_ranks, dims.world_size), name
        assert lay["mode"] == dims.mode and lay["ranks_per_node"] == dims.ranks_per_node, name
    assert [plans[n]["layout"]["data_ranks"] for n in SEARCHES] == [2, 2, 2]
    assert plans["single"]["layout"]["data_ranks"] == 1
    whatif = _plan(root, "whatif")["whatif"]
    assert plans["whatif"]["layout"]["data_ranks"] == whatif["world_size"]
    assert plans["whatif"]["layout"]["nodes"] == whatif["nodes"]
    page = client.get("/").text
    for entry in plans.values():
        assert cluster.layout_cell(entry["layout"]).replace("'", "&#x27;") in page


def test_hsdp_and_other_sections_count_replicate_times_shard(seed):
    rng = random.Random(seed)
    r, s = rng.randint(2, 16), rng.choice([2, 4, 8])
    hsdp = cluster.layout({"parallel": {"replicate": r, "shard": s, "engine": "fsdp2", "ranks_per_node": s,
                                        "weight_gather": "int8"}, "gradients": {"mode": "sdp4bit"}})
    assert (hsdp["mode"], hsdp["data_ranks"], hsdp["world_size"], hsdp["nodes"]) == ("hsdp", r * s, r * s, r)
    assert "int8" in hsdp["weight_gather"] and "TLq-HS" in hsdp["gradients_wire"]
    stages = rng.randint(2, 8)
    pipe = cluster.layout({"parallel": {"pipeline": stages}, "gradients": {"mode": "bf16"}})
    assert (pipe["mode"], pipe["data_ranks"], pipe["world_size"]) == ("pipeline", 1, stages)
    n = rng.randint(2, 64)  # a plan before schema 1.8: its launch
    old = cluster.layout({"launch": {"processes": n, "parallel": "fsdp"}, "gradients": {"mode": "sdp4bit"}})
    assert (old["mode"], old["data_ranks"], old["shard"]) == ("fsdp", n, n)
    # agoq's retired own sharded step: its launch gives no layout, its section says it was retired
    assert cluster.layout({"launch": {"processes": n, "parallel": "sharded"}, "gradients": {"mode": "sdp4bit"}}) is None
    retired = cluster.layout({"parallel": {"shard": n, "engine": "sdp4bit"}, "gradients": {"mode": "sdp4bit"}})
    assert "retired" in retired["mode"] and "--parallel fsdp" in retired["mode"] and retired["weight_gather"] is None
    assert cluster.layout({"layers": []}) is None


def _knobs(row):
    return ProblemSettings(layout=row["layout"], gradient_mode=row["gradients"], weight_gather=row["weight_gather"],
                           micro_batch=row["micro_batch"], grad_accum=row["grad_accum"], optimizer=row["optimizer"],
                           master=row["master"], compile_mode=row["compile"], layer_stage=(0, 0, 0),
                           allow_offload=False)


def test_plan_page_shows_the_layout_and_each_layout_step_beside_its_prices(root, tmp_path):
    client = TestClient(create_app(root))
    data = client.get("/api/plan", params={"id": "fsdp/plan.json"}).json()
    plan = _plan(root, "fsdp")
    lay = data["cluster"]["layout"]
    assert {k: lay[k] for k in ("replicate", "shard", "pipeline", "engine")} == \
        {k: plan["parallel"].get(k) for k in ("replicate", "shard", "pipeline", "engine")}
    assert lay["launch"] == plan["launch"]["command"] and "bf16 reduce-scatter" in lay["gradients_wire"]
    # the prices, computed here: the profile calibrated on its layout steps, and the same profile without them
    calibrated = load_profile(root / "prof")
    header = json.loads((root / "prof" / "profile.json").read_text())
    measured = header.pop("layout_steps")["rows"]
    bare = tmp_path / "bare"
    shutil.copytree(root / "prof", bare)
    (bare / "profile.json").write_text(json.dumps(header))
    model = load_profile(bare)
    rows = data["cluster"]["layout_steps"]["rows"]
    assert len(rows) == len(measured) and data["cluster"]["layout_steps"]["world_size"] == 2
    page = client.get("/plan", params={"id": "fsdp/plan.json"}).text
    assert "<h2>Layout steps</h2>" in page and "replicate x shard x pipeline" in page
    for got, want in zip(rows, measured):
        assert (got["layout"], got["gradients"], got["step_seconds"]) == \
            (want["layout"], want["gradients"], want["step_seconds"])
        config = Configuration(_knobs(want))
        after, before = price(calibrated, config), price(model, config)
        assert got["calibrated_step_seconds"] == pytest.approx(after.step_seconds, rel=1e-12)
        assert got["calibrated_communication_seconds"] == pytest.approx(after.communication_seconds, rel=1e-12)
        assert got["model_step_seconds"] == pytest.approx(before.step_seconds, rel=1e-12)
        assert got["model_peak_bytes"] == before.peak_bytes and got["calibrated_peak_bytes"] == after.peak_bytes
        assert got["calibrated_step_seconds"] == pytest.approx(want["step_seconds"], rel=1e-9)  # at its own step
        assert got["mine"] == ((want["layout"], want["gradients"], want["weight_gather"]) == ("fsdp", "bf16", "bf16"))
        for value in (want["step_seconds"], before.step_seconds):
            assert fmt_seconds(value) in page


def test_the_profile_page_shows_its_layout_steps(root):
    client = TestClient(create_app(root))
    data = client.get("/api/profile", params={"id": "prof"}).json()
    plan_view = client.get("/api/plan", params={"id": "ddp/plan.json"}).json()["cluster"]["layout_steps"]
    assert [{k: v for k, v in r.items() if k != "mine"} for r in data["layout_steps"]["rows"]] == \
        [{k: v for k, v in r.items() if k != "mine"} for r in plan_view["rows"]]
    page = client.get("/profile", params={"id": "prof"}).text
    assert "<h2>Layout steps</h2>" in page
    assert all(fmt_seconds(r["model_step_seconds"]) in page for r in data["layout_steps"]["rows"])
    assert client.get("/api/profile", params={"id": "one"}).json()["layout_steps"] is None


def test_a_what_if_plan_shows_its_nodes_and_a_one_rank_plan_no_layout(root):
    client = TestClient(create_app(root))
    whatif = _plan(root, "whatif")["whatif"]
    lay = client.get("/api/plan", params={"id": "whatif/plan.json"}).json()["cluster"]["layout"]
    assert (lay["ranks_per_node"], lay["nodes"]) == (whatif["node_size"], whatif["nodes"])
    assert lay["launch"] == whatif["launch"] and lay["whatif"]["measured_world_size"] == 2
    page = client.get("/plan", params={"id": "whatif/plan.json"}).text
    assert "A what-if plan" in page and f"--nnodes {whatif['nodes']}" in page
    single = client.get("/api/plan", params={"id": "single/plan.json"}).json()
    assert single["cluster"] is None
    assert "<h2>Layout</h2>" not in client.get("/plan", params={"id": "single/plan.json"}).text


def test_a_one_gpu_profiles_one_rank_layout_steps_are_shown_measured_not_priced(tmp_path, seed):
    """A one-GPU profile's layout steps (one process running FSDP2: a what-if's anchor) are listed with their
    measured step and peak, and no price or error (fsdp is not priced on one rank)."""
    from tests.search.test_whatif_one_rank import _one_gpu_profile, _row, _with_layout_steps as one_rank_steps

    rng = random.Random(seed)
    folder = _one_gpu_profile(tmp_path / "one", rng)
    kinds = [("fsdp", "bf16", "bf16"), ("fsdp", "sdp4bit", "int8"), ("fsdp", "sdp4bit", "int4")]
    rows = [_row(k, "eager", rng.uniform(0.01, 0.2), rng.randrange(10**6, 10**8)) for k in kinds]
    one_rank_steps(folder, rows)
    client = TestClient(create_app(tmp_path))
    data = client.get("/api/profile", params={"id": "one"}).json()["layout_steps"]
    assert data["world_size"] == 1
    assert [r["step_seconds"] for r in data["rows"]] == [r["step_seconds"] for r in rows]
    assert all("error" not in r and "calibrated_step_seconds" not in r for r in data["rows"])
    page = client.get("/profile", params={"id": "one"}).text
    assert "One process running FSDP2" in page and "class=bad" not in page
    assert all(fmt_seconds(r["step_seconds"]) in page for r in rows)
