"""The dashboard's JSON API and pages through FastAPI's TestClient: every endpoint on real stage
outputs and on format-conformant synthetic folders, values checked against the files read
independently, bad ids, traversal attempts, tokens, broken files, and that nothing under the root is
ever written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fastapi.testclient import TestClient

from dashboard.app import create_app

PAGES = {"profiles": "/profile", "searches": "/search", "plans": "/plan", "runs": "/runs"}
APIS = {"profiles": "/api/profile", "searches": "/api/search", "plans": "/api/plan", "runs": "/api/run"}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under root with its size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def visit_everything(client: TestClient, present=tuple(PAGES), readable_run: bool = True) -> dict:
    """GET every API endpoint and page for everything the index lists, and the fixed pages; returns the index.

    An item the index marks broken answers 422, any other 200, and its page answers as its API did, except
    /runs: it compares runs and answers 200, with a message for each broken one. `present`: the kinds the
    index must list at least one item of; `readable_run`: whether one of its runs must be readable (their
    curves are then fetched together)."""
    index = client.get("/api/index?refresh=1").json()
    for kind in present:
        assert index[kind], (kind, index)
    runs = [r["id"] for r in index["runs"] if "error" not in r]
    assert bool(runs) == readable_run, index["runs"]
    for kind in PAGES:
        for item in index[kind]:
            expect = 200 if "error" not in item else 422
            api = client.get(APIS[kind], params={"id": item["id"]})
            assert api.status_code == expect, (kind, item["id"], api.text)
            page = client.get(PAGES[kind], params={"id": item["id"]})
            assert "<html" in page.text
            if kind == "runs":
                assert page.status_code == 200, (item["id"], page.text)
                assert ('class="msg error"' in page.text) == ("error" in item), (item, page.text)
            else:
                assert page.status_code == api.status_code, (kind, item["id"], page.text)
    if runs:
        r = client.get("/api/curves", params=[("id", i) for i in runs[:12]] + [("points", 100)])
        assert r.status_code == 200
        assert [c["id"] for c in r.json()["runs"]] == runs[:12]
    for path in ("/", "/runs", "/static/plotly.min.js", "/static/dashboard.js", "/static/dashboard.css",
                 "/openapi.json", "/docs"):
        assert client.get(path).status_code == 200, path
    return index


# --- real outputs of the stages -----------------------------------------------------------------------

def test_real_outputs_every_endpoint_and_values(stage_root):
    before = snapshot(stage_root)
    client = TestClient(create_app(stage_root))
    index = visit_everything(client)
    assert [p["id"] for p in index["profiles"]] == ["demo/profile"]
    assert [s["id"] for s in index["searches"]] == ["demo/search"]
    assert {r["id"] for r in index["runs"]} == {"demo/runs/baseline", "demo/runs/plan"}
    assert "demo/search/plan.json" in [p["id"] for p in index["plans"]]
    assert all("error" not in item for kind in PAGES for item in index[kind]), index
    # a search's budget is its chosen plan's, not the first front row's
    chosen_budget = json.loads((stage_root / "demo/search/plan.json").read_text())["budget_bytes"]
    assert index["searches"][0]["budget_bytes"] == chosen_budget

    # profile heat maps hold exactly the parquet's values
    table = pd.read_parquet(stage_root / "demo/profile/profile.parquet")
    prof = client.get("/api/profile", params={"id": "demo/profile", "option": "4"}).json()
    maps = prof["maps"]
    assert maps["option"] == "4"
    for i, layer in enumerate(maps["layers"]):
        for j, kind in enumerate(maps["kinds"]):
            row = table[(table.layer == layer) & (table.kind == kind) & (table.option.astype(str) == "4")]
            if len(row) == 0:
                assert maps["sensitivity"][i][j] is None
                continue
            row = row[row.format == "int"] if len(row) > 1 else row
            assert maps["sensitivity"][i][j] == pytest.approx(float(row.sensitivity.iloc[0]), rel=1e-12)
            assert maps["bytes"][i][j] == int(row.bytes.iloc[0])

    # the time each option adds, per kind, is the parquet's mean over layers
    times = {r["kind"]: r for r in prof["times"]["rows"]}
    assert set(times) == set(table.kind)
    for kind, part in table[table.format.astype(str) == "int"].groupby("kind"):
        four = part[part.option.astype(str) == "4"]
        assert len(four), kind  # every kind has a 4-bit option (the demo profiles 2, 4 and 8 bits)
        assert times[kind]["4"] == pytest.approx(float((four.quantize_seconds + four.dequantize_seconds).mean()))
    recomputed = table[table.option.astype(str) == "recompute"]
    assert len(recomputed)
    for kind, part in recomputed.groupby("kind"):
        assert times[kind]["recompute"] == pytest.approx(float(part.recompute_seconds.mean()))
    assert "Time each option adds" in client.get("/profile", params={"id": "demo/profile"}).text

    # collective times per (op, path) are the parquet's
    coll = pd.read_parquet(stage_root / "demo/profile/collectives.parquet")
    series = prof["collectives"]["series"]
    assert set(coll.backend) == {"gloo"}  # the demo's collectives ran between CPU processes
    shown = {p: p.replace("nccl-", "gloo-") for p in coll.path}  # torch's own collectives named by their backend
    assert {(s["op"], s["path"]) for s in series} == {(o, shown[p]) for o, p in zip(coll.op, coll.path)}
    for s in series:
        stored = next(p for p, label in shown.items() if label == s["path"])
        part = coll[(coll.op == s["op"]) & (coll.path == stored)].sort_values("message_bytes")
        assert s["message_bytes"] == part.message_bytes.tolist()
        assert s["seconds"] == pytest.approx(part.seconds.tolist(), rel=1e-12)

    # the chosen plan is linked to the run that trained with it, and its bit map is the plan's
    plan = json.loads((stage_root / "demo/search/plan.json").read_text())
    search = client.get("/api/search", params={"id": "demo/search"}).json()
    # the Pareto chart's reference points are the profile's measured steps
    steps = json.loads((stage_root / "demo/profile/profile.json").read_text())["memory"]["steps"]
    assert {r["name"]: (r["peak_bytes"], r["step_seconds"]) for r in search["references"]} == \
        {st["policy"]: (st["predicted_peak_bytes"], st["step_seconds"]) for st in steps}
    assert {"bf16", "agoq-paper"} <= {r["name"] for r in search["references"]}
    chosen = search["chosen_plan"]
    assert chosen["id"] == "demo/search/plan.json"
    assert chosen["runs"] == ["demo/runs/plan"]
    for entry, row in zip(sorted(plan["layers"], key=lambda e: e["layer"]), chosen["bits"]["bits"]):
        for kind, value in zip(chosen["bits"]["kinds"], row):
            want = -1 if entry.get("checkpoint") else 0 if entry["kinds"][kind] == "recompute" else entry["kinds"][kind]
            assert value == want
    memory = chosen["memory"]  # the parts the search recorded, adding up to each stage's peak
    assert memory["parts_recorded"] is True
    for s, entry in enumerate(plan["predicted"]["memory_per_stage"]):
        assert {k: v[s] for k, v in memory["predicted_parts"].items()} == entry["parts"]
        assert sum(entry["parts"].values()) == plan["predicted"]["peak_bytes_per_stage"][s]
    profile_steps = json.loads((stage_root / "demo/profile/profile.json").read_text())["memory"]["steps"]
    bf16_peak = next(s["predicted_peak_bytes"] for s in profile_steps if s["policy"] == "bf16")
    assert chosen["summary"]["bf16_predicted_peak_bytes"] == bf16_peak
    assert chosen["summary"]["predicted_peak_bytes"] == max(plan["predicted"]["peak_bytes_per_stage"])
    assert chosen["summary"]["profiled_on"] == plan["source"]["device"] == "cpu"  # the demo profiles on the CPU
    assert chosen["memory"]["cpu_runs"] == ["demo/runs/plan"]  # a CPU run's process memory is not compared
    assert len(search["pareto"]["rows"]) >= 1

    # the curves are the metrics file's lines
    lines = [json.loads(x) for x in (stage_root / "demo/runs/plan/metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    val = [x for x in lines if "val_loss" in x and "loss" not in x]
    curves = client.get("/api/curves", params={"id": "demo/runs/plan"}).json()["runs"][0]["curves"]
    assert curves["series"]["loss"]["value"] == pytest.approx([x["loss"] for x in train])
    assert curves["series"]["val_loss"]["value"] == pytest.approx([x["val_loss"] for x in val])
    assert curves["peak_bytes"][0]["value"] == [x["peak_bytes"][0] for x in train]
    summary = client.get("/api/run", params={"id": "demo/runs/baseline"}).json()["summary"]
    assert summary["status"] == "finished" and summary["plan"] == "baseline (no plan), fp32"  # on the CPU: float32
    assert snapshot(stage_root) == before


# --- synthetic folders: what a short session cannot produce ---------------------------------------------

def test_synthetic_every_endpoint_and_read_only(synthetic_root):
    before = snapshot(synthetic_root)
    client = TestClient(create_app(synthetic_root))
    index = visit_everything(client)
    assert {s["id"] for s in index["searches"]} == {"search", "journal-search"}
    assert {r["id"] for r in index["runs"]} == {"runs/two-ranks", "runs/long"}
    assert snapshot(synthetic_root) == before  # no -journal/-wal files, no caches, nothing touched


def test_long_run_is_thinned_keeping_extremes(synthetic_root):
    lines = (synthetic_root / "runs/long/metrics.jsonl").read_text().splitlines()
    train = [json.loads(x) for x in lines if '"loss"' in x]
    loss = np.array([x["loss"] for x in train])
    client = TestClient(create_app(synthetic_root))
    points = 601
    r = client.get("/api/curves", params={"id": "runs/long", "points": points}).json()["runs"][0]["curves"]
    assert r["train_points"] == 100_000 == len(train)
    got = r["series"]["loss"]
    assert len(got["step"]) <= points and len(got["step"]) > points // 2
    assert got["step"] == sorted(got["step"])
    assert got["step"][0] == train[0]["step"] and got["step"][-1] == train[-1]["step"]
    assert min(got["value"]) == loss.min() and max(got["value"]) == loss.max()
    for series in (r["series"]["tokens_per_s"], r["peak_bytes"][0], r["series"]["val_loss"]):
        assert len(series["step"]) <= points
    page = client.get("/runs", params={"id": "runs/long"})
    assert page.status_code == 200 and len(page.content) < 2_000_000


def test_several_ranks_and_stages(synthetic_root):
    client = TestClient(create_app(synthetic_root))
    lines = [json.loads(x) for x in (synthetic_root / "runs/two-ranks/metrics.jsonl").read_text().splitlines()]
    peaks = np.array([x["peak_bytes"] for x in lines if "loss" in x])
    curves = client.get("/api/curves", params={"id": "runs/two-ranks"}).json()["runs"][0]["curves"]
    assert [p["rank"] for p in curves["peak_bytes"]] == [0, 1]
    for r in (0, 1):
        assert curves["peak_bytes"][r]["value"] == peaks[:, r].tolist()
    plan = client.get("/api/plan", params={"id": "search/plan.json"}).json()
    mem = plan["memory"]
    written = json.loads((synthetic_root / "search/plan.json").read_text())
    assert mem["stages"] == [0, 1]
    # a plan written before its peak's parts were recorded: its peaks, no parts made up here
    assert mem["parts_recorded"] is False and mem["predicted_parts"] == {} and mem["phases"] == [None, None]
    assert mem["predicted_peak"] == pytest.approx(written["predicted"]["peak_bytes_per_stage"])
    assert mem["measured_peak"]["plan validation"] == pytest.approx(written["measured"]["peak_bytes_per_stage"])
    assert mem["measured_peak"]["run runs/two-ranks"] == [int(peaks[:, 0].max()), int(peaks[:, 1].max())]
    search = client.get("/api/search", params={"id": "search"}).json()
    assert [r["validated"] for r in search["pareto"]["rows"]] == [True, False]
    assert search["study"]["studies"][0]["states"] == {"COMPLETE": 6}
    journal = client.get("/api/search", params={"id": "journal-search"}).json()
    assert journal["study"]["file"] == "study.journal"
    assert len(journal["study"]["studies"][0]["trials"]) == 5
    assert journal["chosen_plan"]["id"] == "journal-search/best.json"  # the one plan file beside the study
    assert journal["pareto"]["rows"] == [] and journal["pareto"]["message"]
    coll = client.get("/api/profile", params={"id": "prof"}).json()["collectives"]
    table = pd.read_parquet(synthetic_root / "prof/collectives.parquet")
    assert {(s["op"], s["path"]) for s in coll["series"]} == set(zip(table.op, table.path)) and len(table)
    for s in coll["series"]:
        part = table[(table.path == s["path"]) & (table.op == s["op"])].sort_values("message_bytes")
        assert s["seconds"] == pytest.approx(part.seconds.tolist())


# --- bad requests ------------------------------------------------------------------------------------

def test_bad_ids_and_parameters(synthetic_root):
    client = TestClient(create_app(synthetic_root))
    for api in APIS.values():
        assert client.get(api, params={"id": "no/such/thing"}).status_code == 404
        assert client.get(api).status_code == 422  # id missing
    assert client.get("/api/profile", params={"id": "search"}).status_code == 404  # wrong kind
    assert client.get("/api/curves", params={"id": "runs/long", "points": 2}).status_code == 422
    assert client.get("/api/curves", params={"id": "runs/long", "points": "many"}).status_code == 422
    assert client.get("/api/curves", params=[("id", "runs/long")] * 13).status_code == 422
    assert client.get("/runs", params={"id": "runs/long", "x": "sideways"}).status_code == 422
    assert client.get("/runs", params={"id": "runs/long", "points": 10**9}).status_code == 422
    bad_option = client.get("/api/profile", params={"id": "prof", "option": "7"}).json()
    assert "error" in bad_option["maps"] and "option" in bad_option["maps"]["error"]
    for page in ("/profile", "/search", "/plan"):
        r = client.get(page, params={"id": "no/such/thing"})
        assert r.status_code == 404 and "nothing named no/such/thing" in r.text
    r = client.get("/runs", params={"id": "no/such/thing"})
    assert r.status_code == 200 and "no run named no/such/thing" in r.text
    assert client.get("/static/../app.py").status_code == 404
    assert client.get("/static/%2e%2e%2fapp.py").status_code == 404


@pytest.fixture()
def escape_root(tmp_path):
    """A root with a run inside, and symlinks (to a folder, to run.json) leading to a run outside it."""
    rng = np.random.default_rng(1)
    from tests.dashboard import synthetic

    outside = tmp_path / "outside"
    synthetic.write_run(outside / "secret", rng, 5)
    root = tmp_path / "root"
    synthetic.write_run(root / "inside", rng, 5)
    (root / "linked-dir").symlink_to(outside / "secret", target_is_directory=True)
    (root / "linked-file").mkdir()
    (root / "linked-file" / "run.json").symlink_to(outside / "secret" / "run.json")
    (root / "linked-file" / "metrics.jsonl").symlink_to(outside / "secret" / "metrics.jsonl")
    synthetic.write_run(root / "ok-link-target", rng, 5)
    (root / "inner-link").mkdir()
    (root / "inner-link" / "run.json").symlink_to(root / "ok-link-target" / "run.json")
    return root


def test_no_path_leads_outside_the_root(escape_root):
    client = TestClient(create_app(escape_root))
    index = client.get("/api/index").json()
    ids = {r["id"] for r in index["runs"]}
    assert ids == {"inside", "ok-link-target", "inner-link"}
    assert any("linked-file" in p for p in index["problems"])
    attempts = ["../outside/secret", "linked-dir", "linked-file", "inside/../../outside/secret",
                str(escape_root.parent / "outside" / "secret"), "/etc", "/", "..", "inside/..", "./inside",
                "inside/", "%2e%2e/outside/secret", "..%2Foutside%2Fsecret", "inside\\..\\..\\outside\\secret"]
    for attempt in attempts:
        for api in ("/api/run", "/api/curves"):
            r = client.get(api, params={"id": attempt})
            assert r.status_code == 404, (api, attempt, r.text)
    # the same attempts written straight into the URL, percent-encoded by hand
    for raw in ("/api/run?id=..%2Foutside%2Fsecret", "/api/run?id=%2Fetc%2Fpasswd",
                "/api/run?id=%252e%252e%252Foutside%252Fsecret", "/api/run?id=linked-dir%2F..%2F..%2Foutside"):
        assert client.get(raw).status_code == 404, raw
    assert client.get("/api/run", params={"id": "inside"}).status_code == 200


def test_symlinks_leading_outside_are_skipped_and_said(tmp_path):
    """A profile folder, a run folder and a plan file symlinked from outside the root are not read, and the index
    (and the overview page) says which and why; so for a broken symlink. A symlink to a folder inside the root
    is no problem: the folder is listed under its own path."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    from tests.dashboard import synthetic

    outside, root = tmp_path / "outside", tmp_path / "root"
    synthetic.write_profile(outside / "prof", rng, 3, "00112233aabbccdd")
    synthetic.write_run(outside / "run", rng, 7)
    (outside / "plan.json").write_text(json.dumps(synthetic.make_plan(rng, 3, "00112233aabbccdd")))
    synthetic.write_run(root / "mine", rng, 7)
    (root / "linked").mkdir()
    (root / "linked" / "prof").symlink_to(outside / "prof", target_is_directory=True)
    (root / "linked-run").symlink_to(outside / "run", target_is_directory=True)
    (root / "linked" / "plan.json").symlink_to(outside / "plan.json")
    (root / "gone").symlink_to(tmp_path / "no-such-folder", target_is_directory=True)
    (root / "mine-again").symlink_to(root / "mine", target_is_directory=True)
    client = TestClient(create_app(root))
    index = client.get("/api/index").json()
    assert [r["id"] for r in index["runs"]] == ["mine"] and index["profiles"] == [] and index["plans"] == []
    notes = {p.split(":")[0]: p for p in index["problems"]}
    assert set(notes) == {"linked/prof", "linked-run", "linked/plan.json", "gone"}, index["problems"]
    for name in ("linked/prof", "linked-run"):
        assert "a symlink to a folder outside the root, not read" in notes[name]
    assert "a symlink to a file outside the root, not read" in notes["linked/plan.json"]
    assert "broken symlink" in notes["gone"]
    page = client.get("/").text
    assert "Skipped" in page and all(name in page for name in notes)


# --- access rules ------------------------------------------------------------------------------------

def test_token_is_required_everywhere(synthetic_root):
    client = TestClient(create_app(synthetic_root, token="s3cret-token-1"))
    for path in ("/", "/api/index", "/static/plotly.min.js", "/openapi.json", "/docs", "/runs"):
        assert client.get(path).status_code == 401, path
    assert client.get("/api/index", params={"token": "wrong-token-11"}).status_code == 401
    assert client.get("/api/index", headers={"x-agoq-token": "s3cret-token-1"}).status_code == 200
    assert client.get("/api/index", headers={"authorization": "Bearer s3cret-token-1"}).status_code == 200
    first = client.get("/runs", params={"token": "s3cret-token-1", "id": "runs/long"}, follow_redirects=False)
    assert first.status_code == 303 and "agoq_dashboard_token" in first.headers["set-cookie"]
    assert first.headers["location"] == "/runs?id=runs%2Flong"  # the token leaves the address
    assert client.get(first.headers["location"]).status_code == 200  # the cookie now carries it
    assert client.get("/api/index").status_code == 200
    client.cookies.clear()
    assert client.get("/api/index").status_code == 401


def test_host_header_is_checked_without_token(synthetic_root):
    client = TestClient(create_app(synthetic_root, allowed_hosts={"127.0.0.1", "localhost"}),
                        base_url="http://127.0.0.1:8000")
    assert client.get("/api/index").status_code == 200
    assert client.get("/api/index", headers={"host": "evil.example:8000"}).status_code == 400
    assert client.get("/api/index", headers={"host": "127.0.0.1.evil.example"}).status_code == 400
    ipv6 = TestClient(create_app(synthetic_root, allowed_hosts={"::1"}))
    assert ipv6.get("/api/index", headers={"host": "[::1]:8000"}).status_code == 200
    assert ipv6.get("/api/index", headers={"host": "[::2]:8000"}).status_code == 400


def test_command_refuses_other_hosts_without_token(synthetic_root, monkeypatch, capsys):
    import uvicorn

    from agoq.cli import main

    import dashboard.command

    served, probed = {}, []
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: served.update(app=app, host=host, port=port))
    # the port check binds for real: the default port 8000 may be taken by a dashboard the user started
    monkeypatch.setattr(dashboard.command, "_check_port_free", lambda host, port: probed.append((host, port)))
    monkeypatch.delenv("AGOQ_DASHBOARD_TOKEN", raising=False)
    assert main(["dashboard", "--root", str(synthetic_root), "--host", "0.0.0.0"]) == 2
    assert "token" in capsys.readouterr().err
    assert not served
    assert main(["dashboard", "--root", str(synthetic_root / "nope")]) == 2
    monkeypatch.setenv("AGOQ_DASHBOARD_TOKEN", "from-env-token")
    assert main(["dashboard", "--root", str(synthetic_root), "--host", "0.0.0.0", "--port", "8123"]) == 0
    assert served["host"] == "0.0.0.0" and served["port"] == 8123
    client = TestClient(served["app"])
    assert client.get("/api/index").status_code == 401
    assert client.get("/api/index", headers={"x-agoq-token": "from-env-token"}).status_code == 200
    monkeypatch.delenv("AGOQ_DASHBOARD_TOKEN")
    assert main(["dashboard", "--root", str(synthetic_root)]) == 0
    assert served["host"] == "127.0.0.1" and served["port"] == 8000
    assert probed == [("0.0.0.0", 8123), ("127.0.0.1", 8000)]


def test_command_refuses_a_port_in_use(synthetic_root, monkeypatch, capsys):
    """A port something already listens on is refused before serving (an OS-chosen free port, taken here)."""
    import socket

    import uvicorn

    from agoq.cli import main

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: pytest.fail("served on a port in use"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["dashboard", "--root", str(synthetic_root), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err


# --- broken and empty folders, new folders --------------------------------------------------------------

def test_broken_files_are_messages_not_500(synthetic_root, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(synthetic_root / "prof", root / "bad-json")
    (root / "bad-json" / "profile.json").write_text("{ not json")
    shutil.copytree(synthetic_root / "prof", root / "newer")
    meta = json.loads((root / "newer" / "profile.json").read_text())
    (root / "newer" / "profile.json").write_text(json.dumps({**meta, "schema": "agoq.profile/9"}))
    shutil.copytree(synthetic_root / "prof", root / "bad-parquet")
    (root / "bad-parquet" / "profile.parquet").write_bytes(b"PAR1 this is not parquet")
    (root / "bad-parquet" / "collectives.parquet").write_bytes(b"")
    (root / "search").mkdir()
    (root / "search" / "pareto.csv").write_text("a,b\n1,2\n")
    (root / "search" / "study.db").write_bytes(b"SQLite format 3\0 garbage" * 10)
    (root / "search" / "plan.json").write_text(json.dumps({"schema": "agoq.plan/1", "layers": "none"}))
    shutil.copytree(synthetic_root / "runs" / "two-ranks", root / "run-bad-lines")
    with open(root / "run-bad-lines" / "metrics.jsonl", "a") as f:
        f.write("garbage\n[1, 2]\n{\"no_step\": 1}\n{\"step\": 99, \"loss\": NaN, \"peak_bytes\": [1, 2]}\n")
    (root / "run-broken").mkdir()
    (root / "run-broken" / "run.json").write_text("[]")
    before = snapshot(root)
    client = TestClient(create_app(root))
    index = client.get("/api/index").json()
    errors = {item["id"]: item.get("error") for kind in PAGES for item in index[kind]}
    assert "not valid JSON" in errors["bad-json"]
    assert "newer" in errors["newer"]
    assert errors["bad-parquet"] is None  # profile.json is fine; the table's error shows in its part
    assert errors["search"] is None  # a search has no main file: its parts carry the problems
    search_entry = next(s for s in index["searches"] if s["id"] == "search")
    assert any("missing column" in p for p in search_entry["problems"])
    assert "layers" in errors["search/plan.json"]
    assert "run.json must hold a JSON object, got list" in errors["run-broken"]
    prof = client.get("/api/profile", params={"id": "bad-parquet"}).json()
    assert "parquet" in prof["maps"]["error"] and "parquet" in prof["collectives"]["error"]
    assert client.get("/api/profile", params={"id": "bad-json"}).status_code == 422
    search = client.get("/api/search", params={"id": "search"}).json()
    assert "missing column" in search["pareto"]["error"]
    assert "Optuna" in search["study"]["error"]
    run = client.get("/api/run", params={"id": "run-bad-lines"}).json()
    assert run["summary"]["bad_lines"] == 3
    curves = client.get("/api/curves", params={"id": "run-bad-lines"}).json()["runs"][0]["curves"]
    assert curves["series"]["loss"]["value"][-1] is None  # NaN loss kept as a gap, valid JSON
    # a page that shows one broken item answers 422, as its API does; pages that show parts of items or
    # several runs answer 200 with the problems in them
    for path, status in [("/", 200), ("/runs?id=run-broken&id=run-bad-lines", 200), ("/profile?id=bad-parquet", 200),
                         ("/profile?id=bad-json", 422), ("/search?id=search", 200),
                         ("/plan?id=search/plan.json", 422)]:
        r = client.get(path)
        assert r.status_code == status, (path, r.status_code)
        assert 'class="msg error"' in r.text or 'class="bad"' in r.text, path
    visit_everything(client)
    assert snapshot(root) == before


def test_empty_root_and_new_folders_appear(tmp_path, monkeypatch):
    from dashboard import discovery

    monkeypatch.setattr(discovery, "MIN_RESCAN", 3600.0)  # forced rescans only after an hour
    client = TestClient(create_app(tmp_path, ttl=60))
    page = client.get("/")
    assert page.status_code == 200 and "Nothing found" in page.text
    assert "No runs yet" in client.get("/runs").text
    from tests.dashboard import synthetic

    synthetic.write_run(tmp_path / "later", np.random.default_rng(2), 7)
    assert client.get("/api/index").json()["runs"] == []  # still within the cache time
    assert client.get("/api/run", params={"id": "later"}).status_code == 404  # no forced rescan yet
    monkeypatch.setattr(discovery, "MIN_RESCAN", 0.0)
    assert client.get("/api/run", params={"id": "later"}).status_code == 200  # an unknown id rescans
    assert [r["id"] for r in client.get("/api/index", params={"refresh": True}).json()["runs"]] == ["later"]
    # a run that has only started: no metrics yet, a message instead of empty charts, reloads itself
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "run.json").write_text(json.dumps({"schema": "agoq.run/1", "status": "running"}))
    curves = client.get("/api/curves", params={"id": "new"}).json()["runs"][0]["curves"]
    assert curves["train_points"] == 0 and curves["series"]["loss"]["step"] == []
    page = client.get("/runs", params={"id": "new"}).text
    assert "no metrics yet: new" in page and 'class="plot"' not in page and 'http-equiv="refresh"' in page


def test_metrics_are_read_incrementally(tmp_path):
    from tests.dashboard import synthetic

    rng = np.random.default_rng(3)
    synthetic.write_run(tmp_path / "r", rng, 10, val_every=100)
    client = TestClient(create_app(tmp_path))
    get = lambda: client.get("/api/curves", params={"id": "r"}).json()["runs"][0]["curves"]  # noqa: E731
    assert get()["train_points"] == 10
    path = tmp_path / "r" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"step": 11, "loss": 0.123, "peak_bytes": [5], "time": 1.0}) + "\n")
        f.write('{"step": 12, "loss": 0.0')  # a line still being written
    assert get()["train_points"] == 11
    with open(path, "a") as f:
        f.write('99}\n')
    c = get()
    assert c["train_points"] == 12 and c["series"]["loss"]["value"][-2:] == [0.123, 0.099]
    path.write_text(json.dumps({"step": 1, "loss": 7.0, "time": 1.0}) + "\n")  # rewritten shorter: read again
    assert get()["series"]["loss"]["value"] == [7.0]


def test_pareto_figure_marks_each_validated_point(seed):
    from dashboard.figures import pareto_front

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(7):
        peak, step = float(rng.uniform(1, 9) * 2**30), float(rng.uniform(0.05, 0.2))
        row = {"plan": f"p{i}.json", "predicted_peak_bytes": peak, "predicted_step_seconds": step,
               "predicted_grad_error": float(rng.uniform(0, 0.3)), "measured_peak_bytes": None,
               "measured_step_seconds": None, "validated": False}
        if i % 3 == 0:  # step measured, peak not (a CPU validation)
            row.update(measured_step_seconds=step * 1.2, validated=True)
        if i == 3:
            row.update(measured_peak_bytes=peak * 1.1)
        rows.append(row)
    fig = pareto_front(rows)
    predicted, measured = fig["data"][0], fig["data"][1]
    assert predicted["x"] == pytest.approx([r["predicted_peak_bytes"] / 2**30 for r in rows])
    validated = [r for r in rows if r["validated"]]
    assert measured["y"] == pytest.approx([r["measured_step_seconds"] * 1e3 for r in validated])
    want_x = [(r["measured_peak_bytes"] or r["predicted_peak_bytes"]) / 2**30 for r in validated]
    assert measured["x"] == pytest.approx(want_x)
    star = pareto_front(rows, {"predicted_peak_bytes": 3 * 2**30, "predicted_step_seconds": 0.125})["data"][-1]
    assert star["name"] == "chosen plan" and star["x"] == [3.0] and star["y"] == [125.0]


def test_root_that_is_itself_a_run(tmp_path):
    from tests.dashboard import synthetic

    synthetic.write_run(tmp_path, np.random.default_rng(4), 23)
    client = TestClient(create_app(tmp_path))
    assert [r["id"] for r in client.get("/api/index").json()["runs"]] == ["."]
    assert client.get("/api/curves", params={"id": "."}).json()["runs"][0]["curves"]["train_points"] == 23
    assert client.get("/runs").status_code == 200
    for attempt in ("..", "", "./.", "/"):
        assert client.get("/api/run", params={"id": attempt}).status_code == 404


def test_files_inside_an_artifact_that_lead_outside_are_not_read(synthetic_root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(synthetic_root / "prof", outside / "prof")
    shutil.copytree(synthetic_root / "search", outside / "search")
    shutil.copytree(synthetic_root / "runs" / "two-ranks", outside / "run")
    root = tmp_path / "root"
    shutil.copytree(synthetic_root / "prof", root / "prof")
    for name in ("profile.parquet", "collectives.parquet"):
        (root / "prof" / name).unlink()
        (root / "prof" / name).symlink_to(outside / "prof" / name)
    (root / "search").mkdir()  # found by its own study, while its pareto.csv leads outside
    shutil.copy(synthetic_root / "search" / "study.db", root / "search" / "study.db")
    (root / "search" / "pareto.csv").symlink_to(outside / "search" / "pareto.csv")
    (root / "search2").mkdir()  # found by its own pareto.csv, while its study leads outside
    shutil.copy(synthetic_root / "search" / "pareto.csv", root / "search2" / "pareto.csv")
    (root / "search2" / "study.db").symlink_to(outside / "search" / "study.db")
    (root / "search3").mkdir()  # nothing of its own: not a search at all
    (root / "search3" / "pareto.csv").symlink_to(outside / "search" / "pareto.csv")
    shutil.copytree(synthetic_root / "runs" / "two-ranks", root / "run")
    (root / "run" / "metrics.jsonl").unlink()
    (root / "run" / "metrics.jsonl").symlink_to(outside / "run" / "metrics.jsonl")
    before = snapshot(root)
    client = TestClient(create_app(root))
    prof = client.get("/api/profile", params={"id": "prof"}).json()
    assert "outside the root" in prof["maps"]["error"] and "outside the root" in prof["collectives"]["error"]
    search = client.get("/api/search", params={"id": "search"}).json()
    assert "outside the root" in search["pareto"]["error"] and search["study"]["studies"][0]["name"] == "bits"
    search2 = client.get("/api/search", params={"id": "search2"}).json()
    assert len(search2["pareto"]["rows"]) == 2 and "outside the root" in search2["study"]["error"]
    assert client.get("/api/search", params={"id": "search3"}).status_code == 404
    assert client.get("/api/curves", params={"id": "run"}).status_code == 422
    assert "outside the root" in client.get("/api/curves", params={"id": "run"}).json()["detail"]
    index = client.get("/api/index").json()
    assert "outside the root" in next(r for r in index["runs"] if r["id"] == "run")["error"]
    visit_everything(client, present=("profiles", "searches", "runs"), readable_run=False)
    assert snapshot(root) == before


def test_profile_table_as_csv(synthetic_root, tmp_path):
    """A profile written where pyarrow was missing names profile.csv in profile.json's files."""
    shutil.copytree(synthetic_root / "prof", tmp_path / "prof")
    table = pd.read_parquet(tmp_path / "prof" / "profile.parquet")
    (tmp_path / "prof" / "profile.parquet").unlink()
    (tmp_path / "prof" / "collectives.parquet").unlink()
    table.to_csv(tmp_path / "prof" / "profile.csv", index=False)
    meta = json.loads((tmp_path / "prof" / "profile.json").read_text())
    meta["files"] = {"table": "profile.csv"}
    (tmp_path / "prof" / "profile.json").write_text(json.dumps(meta))
    client = TestClient(create_app(tmp_path))
    maps = client.get("/api/profile", params={"id": "prof", "option": "recompute"}).json()["maps"]
    assert maps["option"] == "recompute"
    for i, layer in enumerate(maps["layers"]):
        for j, kind in enumerate(maps["kinds"]):
            row = table[(table.layer == layer) & (table.kind == kind) & (table.option == "recompute")]
            assert maps["bytes"][i][j] == int(row.bytes.iloc[0])
    assert client.get("/profile", params={"id": "prof"}).status_code == 200
    meta["files"] = {"table": "../../etc/passwd"}
    (tmp_path / "prof" / "profile.json").write_text(json.dumps(meta))
    refused = client.get("/api/profile", params={"id": "prof"})  # profile.json itself is refused (agoq.formats)
    assert refused.status_code == 422 and "files.table" in refused.text and "plain file name" in refused.text


def test_study_figure_separates_trials_over_the_budget(seed):
    from dashboard.figures import study_trials

    rng = np.random.default_rng(seed)
    trials = []
    for n in range(11):
        values = rng.uniform(0, 1, 3).tolist()
        # trial 1 over the budget and trial 2 within it whatever the draws; no constraint: within
        constraint = {1: 0.5, 2: -0.5}.get(n, float(rng.uniform(-1, 1)))
        trials.append({"number": n, "values": values, "params": {},
                       "user_attrs": {"constraint": [constraint]} if n % 4 else {}})
    fig = study_trials({"name": "s", "directions": ["minimize"] * 3, "objectives": ["peak", "time", "error"],
                        "trials": trials})
    feasible = [t for t in trials if all(c <= 0 for c in t["user_attrs"].get("constraint", []))]
    over = [t for t in trials if t not in feasible]
    assert fig["data"][0]["x"] == pytest.approx([t["values"][0] for t in feasible])
    assert fig["data"][0]["marker"]["color"] == pytest.approx([t["values"][2] for t in feasible])
    assert over and fig["data"][1]["y"] == pytest.approx([t["values"][1] for t in over])


def test_sensitivity_map_goes_logarithmic_over_decades(seed):
    from dashboard.figures import profile_maps

    rng = np.random.default_rng(seed)
    sens = (10.0 ** rng.uniform(-5, -1, size=(4, 3))).tolist()
    sens[1][2] = None  # an option that was not measured stays a gap
    maps = {"option": "4", "kinds": ["a", "b", "c"], "layers": [0, 1, 2, 3], "sensitivity": sens,
            "bytes": [[1000, 2000, 3000]] * 4}
    trace = profile_maps(maps)[0]["data"][0]
    for row_z, row_s in zip(trace["z"], sens):
        for z, v in zip(row_z, row_s):
            assert (z is None) if v is None else z == pytest.approx(np.log10(v))
    assert trace["customdata"] == sens
    narrow = {**maps, "sensitivity": [[0.01, 0.02, 0.03]] * 4}
    assert profile_maps(narrow)[0]["data"][0]["z"] == narrow["sensitivity"]


def test_discovery_finds_plans_by_schema_and_skips_the_rest(tmp_path):
    from dashboard.discovery import scan
    from tests.dashboard import synthetic

    plan = synthetic.make_plan(np.random.default_rng(5), 3, "0123456789abcdef")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "front-07.json").write_text(json.dumps(plan))
    (tmp_path / "a" / "report.json").write_text(json.dumps({"reports": [], "note": "agoq.formats.plan is mentioned"}))
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "plan.json").write_text(json.dumps(plan))
    synthetic.write_run(tmp_path / "r", np.random.default_rng(6), 3)
    (tmp_path / "r" / "checkpoint").mkdir()
    (tmp_path / "r" / "checkpoint" / "plan.json").write_text(json.dumps(plan))
    deep = tmp_path.joinpath(*[f"d{i}" for i in range(9)])
    deep.mkdir(parents=True)
    (deep / "plan.json").write_text(json.dumps(plan))
    seen: dict = {}
    index = scan(tmp_path.resolve(), seen=seen)
    assert sorted(index.items["plans"]) == ["a/b/front-07.json"]
    assert sorted(index.items["runs"]) == ["r"]
    # a file rewritten as a plan is seen as one at the next scan
    (tmp_path / "a" / "report.json").write_text(json.dumps(plan) + " ")
    assert sorted(scan(tmp_path.resolve(), seen=seen).items["plans"]) == ["a/b/front-07.json", "a/report.json"]
