"""The dashboard says what is so: a search's "validated" counts the plans that ran, the profile page's slider starts
from the plan made from that profile (its layout, not a default one), the plan's colour bar labels stand apart,
and the overview tells GPU predictions from the CPU run."""

from __future__ import annotations

import html
import json
import random
import re
import shutil

from fastapi.testclient import TestClient

from dashboard.app import create_app
from tests.dashboard import synthetic


def _measured(plan: dict) -> bool:
    m = plan.get("measured") or {}
    return bool(m) and (m.get("step_seconds") is not None or any(v is not None for v in m.get("peak_bytes_per_stage") or []))


def _same(plan: dict) -> str:
    return json.dumps([plan.get(k) for k in ("layers", "activations", "training", "gradients")], sort_keys=True)


# --- "validated N" ----------------------------------------------------------------------------------------------

def test_validated_counts_the_plans_a_real_search_ran(stage_root, tmp_path):
    """`agoq search --validate 2` runs two plans, the chosen one (which is no row of the Pareto front) and one of the
    front: the overview says 2, as many as the plan files written that record a run (distinct plans)."""
    from agoq.cli import main

    root = tmp_path / "root"
    shutil.copytree(stage_root / "demo" / "profile", root / "profile")
    budget = json.loads((stage_root / "demo/search/plan.json").read_text())["budget_bytes"]
    out = root / "search" / "plan.json"
    assert main(["search", "--profile", str(root / "profile"), "--budget", str(budget), "--out", str(out),
                 "--objective", "time", "--layout", "replicated", "--validate", "2", "--validate-steps", "2",
                 "--front-budgets", "4", "--quiet"]) == 0
    ran = {_same(p) for p in (json.loads(f.read_text()) for f in (root / "search").rglob("*.json")) if _measured(p)}
    assert len(ran) == 2  # the premise: the search ran two distinct plans
    searches = TestClient(create_app(root)).get("/api/index").json()["searches"]
    assert [(s["id"], s["validated"]) for s in searches] == [("search", 2)]


def test_validated_counts_distinct_measured_plans(tmp_path, seed):
    """A search folder written as `agoq search` writes one: the chosen plan, the front's plans in plan-pareto/ (one
    of them the chosen plan again) and pareto.csv naming them, some measured; plus a measured row with no plan file."""
    rng = random.Random(seed)
    np_rng = __import__("numpy").random.default_rng(seed)
    folder = tmp_path / "search"
    (folder / "plan-pareto").mkdir(parents=True)
    chosen = synthetic.make_plan(np_rng, 4, "f" * 16)
    chosen_measured = rng.random() < 0.5
    if not chosen_measured:
        chosen["measured"] = None
    (folder / "plan.json").write_text(json.dumps(chosen))
    rows, expected = [], {_same(chosen)} if chosen_measured else set()
    for i in range(rng.randint(3, 7)):
        plan = chosen if i == 0 else synthetic.make_plan(np_rng, 4, "f" * 16)  # the chosen one is on the front too
        measured = _measured(plan) if i == 0 else rng.random() < 0.5
        if not measured:
            plan = {**plan, "measured": None}
        elif i:
            expected.add(_same(plan))
        name = f"plan-pareto/milp-front-{i:02d}.json"
        (folder / name).write_text(json.dumps(plan))
        rows.append([plan["budget_bytes"], 20 * 2**20, 0.05, 0.01, name, "", 0.05 if measured else ""])
    rows.append([2**25, 19 * 2**20, 0.06, 0.02, "", "", 0.07])  # measured, its plan file not written
    with open(folder / "pareto.csv", "w") as f:
        f.write("budget_bytes,predicted_peak_bytes,predicted_step_seconds,predicted_grad_error,plan,"
                "measured_peak_bytes,measured_step_seconds\n")
        f.writelines(",".join(map(str, r)) + "\n" for r in rows)
    searches = TestClient(create_app(tmp_path)).get("/api/index").json()["searches"]
    assert [(s["id"], s["validated"]) for s in searches] == [("search", len(expected) + 1)]
    page = TestClient(create_app(tmp_path)).get("/").text
    assert f"<td>{len(expected) + 1}</td>" in page


# --- the slider's start -----------------------------------------------------------------------------------------

def test_the_slider_starts_from_the_plan_made_from_the_profile(stage_root):
    """The demo searched with --layout replicated and trained that plan: the profile page's slider starts from that
    plan's budget, objective and layout, and the plan the service solves with those settings is replicated too."""
    client = TestClient(create_app(stage_root))
    trained = json.loads((stage_root / "demo/runs/plan/run.json").read_text())["plan"]
    files = {p.relative_to(stage_root).as_posix(): json.loads(p.read_text())
             for p in stage_root.rglob("plan.json")}
    shown = next(i for i, p in files.items() if p["layers"] == trained["layers"] and
                 p["budget_bytes"] == trained["budget_bytes"])
    plan = files[shown]
    page = client.get("/profile", params={"id": "demo/profile"}).text
    start = json.loads(html.unescape(re.search(r'data-start="([^"]*)"', page).group(1)))
    assert start["plan"] == shown
    assert start["layout"] == plan["decision"]["knobs"]["layout"] == "replicated"
    assert start["gradients"] == plan["gradients"]["mode"]
    assert start["budget_bytes"] == plan["budget_bytes"] and start["objective"] == plan["decision"]["objective"]
    assert 'id="plan-start-note"' in page and f"?id={shown}" in page
    body = {"profile": "demo/profile", "budget": start["budget_bytes"],
            **{k: start[k] for k in ("objective", "error_cap", "layout", "gradients")}}
    solved = client.post("/api/plan", json=body)
    assert solved.status_code == 200, solved.text
    got = solved.json()["plan"]
    assert got["decision"]["knobs"]["layout"] == "replicated" and got["launch"]["parallel"] in ("ddp", "none")
    assert got["gradients"]["mode"] == plan["gradients"]["mode"]
    # the layout asked for is the one solved: FSDP when asked
    fsdp = client.post("/api/plan", json={**body, "layout": "fsdp", "gradients": "bf16"})
    if fsdp.status_code == 200:
        assert fsdp.json()["plan"]["launch"]["parallel"] == "fsdp"


def test_a_profile_no_plan_was_made_from_starts_at_the_defaults(tmp_path, seed):
    np_rng = __import__("numpy").random.default_rng(seed)
    synthetic.write_profile(tmp_path / "prof", np_rng, 3, "0123456789abcdef")
    other = synthetic.make_plan(np_rng, 3, "fedcba9876543210")  # a plan for another model
    (tmp_path / "plan.json").write_text(json.dumps(other))
    page = TestClient(create_app(tmp_path)).get("/profile", params={"id": "prof"}).text
    assert 'data-start="{}"' in page and "plan-start-note" not in page
    mine = synthetic.make_plan(np_rng, 3, "0123456789abcdef")
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    page = TestClient(create_app(tmp_path)).get("/profile", params={"id": "prof"}).text
    start = json.loads(html.unescape(re.search(r'data-start="([^"]*)"', page).group(1)))
    assert start["plan"] == "mine.json" and start["budget_bytes"] == mine["budget_bytes"]
    assert start["gradients"] == mine["gradients"]["mode"]  # no decision, no launch: its gradient mode, any layout
    assert start["layout"] is None and start["objective"] == mine["source"]["objective"]


# --- the plan's colour bar --------------------------------------------------------------------------------------

def _hex(c: str) -> tuple:
    return tuple(int(c[i:i + 2], 16) for i in (1, 3, 5))


def _colour(scale: list, x: float) -> tuple:
    """The colour of a Plotly colour scale at x in [0, 1] (linear between stops; at a repeated stop, the upper)."""
    for (a, ca), (b, cb) in zip(scale, scale[1:]):
        if a <= x <= b and b > a:
            t = (x - a) / (b - a)
            return tuple(round(u + (v - u) * t) for u, v in zip(_hex(ca), _hex(cb)))
    return _hex(scale[-1][1])


def test_plan_colour_bar_labels_stand_apart(seed):
    """Every two labels of the bits colour bar are at least a tenth of the bar apart (no "R" on "16"); each label
    sits where the cells it names are, and "R" (recomputed and checkpointed cells) has a colour no bit width has."""
    from dashboard.figures import plan_bits

    rng = random.Random(seed)
    kinds = ["a", "b", "c", "d", "e"]
    widths = [2, 3, 4, 5, 6, 8, 16]
    rows = [rng.sample(widths + [0, None], len(kinds)) for _ in range(6)] + [[-1] * 5, [2, 4, 8, 16, 0]]
    text = [["R" if v == 0 else "ckpt" if v == -1 else "" if v is None else str(v) for v in r] for r in rows]
    fig = plan_bits({"bits": rows, "kinds": kinds, "layers": list(range(8)), "stages": [0] * 8, "text": text})
    trace = fig["data"][0]
    values, labels = trace["colorbar"]["tickvals"], trace["colorbar"]["ticktext"]
    lo, hi = trace["zmin"], trace["zmax"]
    assert len(values) == len(labels) == len(set(labels)) and {"2", "16", "R"} <= set(labels)
    assert all(lo <= v <= hi for v in values)
    gaps = [b - a for a, b in zip(values, values[1:])]
    assert min(gaps) >= 0.1 * (hi - lo), (values, lo, hi)
    cells: dict = {}  # bits (0 for recomputed and checkpointed) -> the z values of its cells
    for row_z, row in zip(trace["z"], rows):
        for z, v in zip(row_z, row):
            if v is not None:
                cells.setdefault(max(v, 0), set()).add(z)
    assert all(len(zs) == 1 for zs in cells.values()), cells
    z_of = {b: zs.pop() for b, zs in cells.items()}
    for value, label in zip(values, labels):  # a label names the cells it sits at
        assert value == z_of[0 if label == "R" else int(label)], (label, value, z_of)
    order = sorted(b for b in z_of if b)
    assert [z_of[b] for b in order] == sorted(z_of[b] for b in order) and z_of[0] > z_of[16]  # more bits: higher
    scale = trace["colorscale"]
    at = lambda z: _colour(scale, (z - lo) / (hi - lo))  # noqa: E731
    r_colour = at(z_of[0])
    assert all(at(z_of[b]) != r_colour for b in order)
    assert at(z_of[16]) == _hex("#1a9850") and r_colour == _hex("#4575b4") and at(z_of[2]) == _hex("#d73027")


# --- GPU predictions and the CPU run ----------------------------------------------------------------------------

def test_the_overview_tells_gpu_predictions_from_the_cpu_run(tmp_path, seed):
    """Beside the demo's CPU profile and run, the example profiles agoq ships (copied as the demo copies them): the
    overview's GPU note names each shipped profile and nothing that ran on the CPU, its CPU note the reverse."""
    from agoq.examples import profiles

    np_rng = __import__("numpy").random.default_rng(seed)
    shipped = profiles()
    assert shipped
    for name, folder in shipped.items():
        shutil.copytree(folder, tmp_path / "examples" / name)
    synthetic.write_profile(tmp_path / "profile", np_rng, 3, "0123456789abcdef")
    meta = json.loads((tmp_path / "profile/profile.json").read_text())
    meta["hardware"] = {"device": "cpu", "name": "x86_64", "count": 1}  # as `agoq profile --device cpu` writes it
    (tmp_path / "profile/profile.json").write_text(json.dumps(meta))
    synthetic.write_run(tmp_path / "runs" / "plan", np_rng, 5)
    meta = json.loads((tmp_path / "runs/plan/run.json").read_text())
    (tmp_path / "runs/plan/run.json").write_text(json.dumps({**meta, "hardware": {"device": "cpu"}}))
    on = {f"examples/{n}": json.loads((f / "profile.json").read_text())["hardware"]["device"] for n, f in shipped.items()}
    on["profile"] = json.loads((tmp_path / "profile/profile.json").read_text())["hardware"]["device"]
    page = TestClient(create_app(tmp_path)).get("/").text
    gpu = re.search(r"<div class='msg info' id='origin-gpu'>(.*?)</div>", page).group(1)
    cpu = re.search(r"<div class='msg info' id='origin-cpu'>(.*?)</div>", page).group(1)
    for profile_id, device in on.items():
        link = f'href="/profile?id={profile_id}"'
        assert (link in gpu, link in cpu) == ((device != "cpu"), (device == "cpu")), (profile_id, device)
    assert 'href="/runs?id=runs/plan"' in cpu and "runs/plan" not in gpu
    assert "agoq ships" in gpu and "predictions" in gpu and "functional check" in cpu
    assert "<td>x86_64 (CPU)</td>" in page  # the CPU profile's device, its machine's name, says CPU


def test_an_empty_root_says_neither(tmp_path):
    page = TestClient(create_app(tmp_path)).get("/").text
    assert "origin-gpu" not in page and "origin-cpu" not in page and "Nothing found under this root" in page
