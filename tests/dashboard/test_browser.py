"""End to end in a real headless Chromium: the dashboard served by uvicorn on a free port, every page
loaded, no JavaScript errors or failed requests, nothing fetched from anywhere but the dashboard, every
chart drawn with data; screenshots are saved as test artifacts (their folder is printed on the
terminal; AGOQ_TEST_ARTIFACTS chooses it)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.dashboard.browser import Chromium, find_chromium

# Each chart: its figure drawn by Plotly, with at least one trace holding points or cells.
CHARTS_DRAWN = """(() => {
  const divs = Array.from(document.querySelectorAll('div.plot'));
  return divs.map(d => d.classList.contains('js-plotly-plot') && d.querySelector('svg.main-svg') !== null
    ? (d._fullData || []).reduce((n, t) => n + ((t.x && t.x.length) || (t.z && t.z.length) || 0), 0) : -1);
})()"""


@pytest.fixture(scope="module")
def served_root(tmp_path_factory, synthetic_root, request):
    """One root holding the real stage outputs (when every stage exists) and the synthetic folders."""
    root = tmp_path_factory.mktemp("served")
    try:
        stage_root = request.getfixturevalue("stage_root")
        shutil.copytree(stage_root / "demo", root / "demo")
    except pytest.skip.Exception:
        if os.environ.get("CI"):
            raise
    shutil.copytree(synthetic_root, root / "synthetic")
    return root


@pytest.fixture(scope="module")
def server(served_root):
    import uvicorn

    from dashboard.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(served_root, token="browser-test-token"), host="127.0.0.1", port=port,
                            log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    binary = find_chromium()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed, and CI must run the browser test (apt-get install chromium)")
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    browser = Chromium(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()


def test_pages_render_in_chromium(server, chromium, served_root, tmp_path_factory, capsys):
    from fastapi.testclient import TestClient

    from dashboard.app import create_app

    artifacts = Path(os.environ.get("AGOQ_TEST_ARTIFACTS") or tmp_path_factory.mktemp("artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    index = TestClient(create_app(served_root)).get("/api/index").json()
    pages = [("overview", "/?token=browser-test-token")]  # the first visit sets the cookie
    pages += [(f"profile-{p['id']}", f"/profile?id={p['id']}") for p in index["profiles"]]
    pages += [(f"search-{s['id']}", f"/search?id={s['id']}") for s in index["searches"]]
    pages += [(f"plan-{p['id']}", f"/plan?id={p['id']}") for p in index["plans"]]
    pages.append(("runs-by-time", "/runs?x=time&" + "&".join(f"id={r['id']}" for r in index["runs"])))
    pages.append(("runs", "/runs?" + "&".join(f"id={r['id']}" for r in index["runs"])))
    if (served_root / "demo").exists():
        assert any(name == "profile-demo/profile" for name, _ in pages)
    charts_seen = 0
    for name, path in pages:
        problems = chromium.open(server + path, "document.body && document.body.dataset.plotsDrawn !== undefined")
        assert problems == [], (path, problems)
        # works offline: every script, style and data request goes to the dashboard itself
        assert chromium.requested and all(u.startswith(server + "/") or u.startswith("data:")
                                          for u in chromium.requested), chromium.requested
        drawn = chromium.evaluate(CHARTS_DRAWN)
        expected = chromium.evaluate("document.querySelectorAll('div.plot').length")
        assert chromium.evaluate("document.body.dataset.plotsDrawn") == str(expected), path
        assert chromium.evaluate("document.body.dataset.plotErrors") == "0", path
        assert all(n > 0 for n in drawn), (path, drawn)
        if name != "overview":
            assert expected >= 1, path
        charts_seen += len(drawn)
        shot = chromium.screenshot(artifacts / (name.replace("/", "_") + ".png"))
        assert shot.stat().st_size > 10_000
    assert "runs" in chromium.evaluate("document.title")
    line = f"dashboard screenshots ({len(pages)} pages, {charts_seen} charts): {artifacts}"
    with capsys.disabled():  # shown even when output is captured
        print("\n" + line)


def test_the_harness_sees_javascript_errors(chromium):
    """The checks above can fail: an uncaught exception, a console error and a failed load are reported."""
    from urllib.parse import quote

    page = ("<html><body><script>console.error('logged on purpose');</script>"
            "<script src='http://127.0.0.1:9/missing.js'></script>"
            "<script>undefinedFunctionOnPurpose();</script></body></html>")
    problems = chromium.open("data:text/html," + quote(page), "true")
    text = "\n".join(problems)
    assert "undefinedFunctionOnPurpose" in text
    assert "logged on purpose" in text
    assert "missing.js" in text or "load failed" in text


def test_budget_slider_redraws_and_saves_the_searchs_plan(chromium, tmp_path, seed):
    """On a profile page: the plan is drawn, moving the slider redraws another plan, and the saved file is the
    one `agoq search` writes for the budget shown."""
    import json
    import random

    from agoq.cli import main
    from dashboard.app import create_app
    from dashboard.command import LOOPBACK_NAMES
    from experiments.service_load import serve
    from tests.search.synthetic_profile import write_profile

    root = (tmp_path / "root").resolve()
    write_profile(root / "prof", random.Random(seed), micro_batch=3, seq_len=37)
    drawn = "document.body.dataset.plansDrawn"
    # what the plan keeps, as drawn (bits per layer and kind) and as chosen (micro-batch x accumulation, gradients,
    # optimizer: a small budget may be met by the split alone)
    bits = ("JSON.stringify([document.getElementById('plan-bits').data[0].z, "
            "window.agoqPlanner.current.plan.training, window.agoqPlanner.current.plan.gradients])")
    with serve(create_app(root, allowed_hosts=LOOPBACK_NAMES)) as (host, port):
        problems = chromium.open(f"http://{host}:{port}/profile?id=prof", f"{drawn} === '1'")
        assert problems == [], problems
        assert chromium.evaluate(drawn) == "1"
        first = chromium.evaluate("window.agoqPlanner.current.budget_bytes")
        seen = {}
        for position, count in ((20, "2"), (985, "3")):
            chromium.evaluate("(() => { const s = document.getElementById('plan-budget'); "
                              f"s.value = {position}; s.dispatchEvent(new Event('input')); }})()")
            deadline = time.monotonic() + 30
            while chromium.evaluate(drawn) != count:
                assert time.monotonic() < deadline, chromium.evaluate("document.getElementById('plan-status').textContent")
                time.sleep(0.1)
            seen[position] = (chromium.evaluate("window.agoqPlanner.current.budget_bytes"), chromium.evaluate(bits))
        budget = seen[985][0]
        assert seen[20][0] < first < budget and chromium.evaluate("document.body.dataset.planBudget") == str(budget)
        assert seen[20][1] != seen[985][1]  # near the smallest budget the plan keeps less than when roomy
        assert str(budget) in chromium.evaluate("document.getElementById('plan-figures').textContent")
        # the best alternative (near the top of the range checkpointing, at least, fits): readable headers, and the
        # speed-up said to be the plan's tokens/s over its
        assert chromium.evaluate("!!window.agoqPlanner.current.alternative")
        heads = chromium.evaluate("Array.from(document.querySelectorAll('#plan-alternative th')).map(h => h.textContent)")
        assert "plan's speed-up (predicted)" in heads and not any("_" in h for h in heads), heads
        assert "the plan's tokens/s" in chromium.evaluate("document.getElementById('plan-alternative').textContent")
        chromium.evaluate("document.getElementById('plan-name').value = 'from-the-slider'; "
                          "document.getElementById('plan-name').dispatchEvent(new Event('input'))")
        artifacts = Path(os.environ.get("AGOQ_TEST_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        assert chromium.screenshot(artifacts / "profile-planner.png").stat().st_size > 10_000
        chromium.evaluate("document.getElementById('plan-save').click()")
        deadline = time.monotonic() + 30
        while chromium.evaluate("document.body.dataset.planSaved || ''") != "plans/from-the-slider.json":
            assert time.monotonic() < deadline, chromium.evaluate("document.getElementById('plan-saved').textContent")
            time.sleep(0.1)
    saved = json.loads((root / "plans" / "from-the-slider.json").read_text())
    out = tmp_path / "cli" / "plan.json"
    assert main(["search", "--profile", str(root / "prof"), "--budget", str(budget), "--out", str(out), "--quiet"]) == 0
    want = json.loads(out.read_text())
    for plan in (saved, want):
        plan["source"].pop("date")
    assert saved == want


def test_below_the_smallest_budget_the_slider_offers_the_smallest(chromium, tmp_path, seed):
    """The slider's range starts where a plan fits with no caps; under the default error cap the low end fits
    nothing. There the page says so and offers the smallest budget that fits; its button moves the slider to the
    first position at or above it, and that plan is drawn."""
    import random

    from dashboard.app import create_app
    from dashboard.command import LOOPBACK_NAMES
    from experiments.service_load import serve
    from tests.search.synthetic_profile import write_profile

    from agoq.formats.profile import load_profile
    from agoq.search.knobs import budget_bounds, solve_knobs
    from agoq.search.milp import InfeasibleBudget
    from agoq.search.request import DEFAULT_ERROR_CAP
    from agoq.search.search import _recipe_cap

    root = (tmp_path / "root").resolve()
    folder = write_profile(root / "prof", random.Random(seed), micro_batch=3, seq_len=37)
    # without the model config whole-layer checkpointing is not offered (no hidden size), so the least memory is
    # had by quantizing, which the default error cap rules out (with checkpointing, checkpointing every layer is
    # the least memory and has no error)
    header = json.loads((folder / "profile.json").read_text())
    del header["model"]["config"]
    (folder / "profile.json").write_text(json.dumps(header))
    profile = load_profile(folder)
    low, high = budget_bounds(profile)
    with pytest.raises(InfeasibleBudget) as e:  # the premise: nothing fits the low end under the recipe's cap
        solve_knobs(profile, low, error_cap=_recipe_cap(profile, DEFAULT_ERROR_CAP, []))
    least = e.value.smallest_budget
    drawn = "document.body.dataset.plansDrawn"
    with serve(create_app(root, allowed_hosts=LOOPBACK_NAMES)) as (host, port):
        assert chromium.open(f"http://{host}:{port}/profile?id=prof", f"{drawn} === '1'") == []
        chromium.evaluate("(() => { const s = document.getElementById('plan-budget'); "
                          "s.value = 0; s.dispatchEvent(new Event('input')); })()")
        deadline = time.monotonic() + 30
        while not chromium.evaluate("!!document.getElementById('plan-smallest')"):
            assert time.monotonic() < deadline, chromium.evaluate("document.getElementById('plan-status').textContent")
            time.sleep(0.1)
        offer = chromium.evaluate("document.getElementById('plan-smallest').textContent")
        shown = chromium.evaluate("document.getElementById('plan-budget-text').textContent")
        assert offer.startswith("move to ") and offer[len("move to "):] != shown, (offer, shown)
        # the plan drawn before (at the first budget) is gone: no table, chart or plan that would seem to answer this
        assert chromium.evaluate("document.getElementById('plan-result').hidden") is True
        assert chromium.evaluate("document.getElementById('plan-figures').textContent") == ""
        assert chromium.evaluate("document.getElementById('plan-bits').data === undefined")
        assert chromium.evaluate("window.agoqPlanner.current") is None
        chromium.evaluate("document.getElementById('plan-smallest').click()")
        deadline = time.monotonic() + 30
        while chromium.evaluate(drawn) != "2":
            assert time.monotonic() < deadline, chromium.evaluate("document.getElementById('plan-status').textContent")
            time.sleep(0.1)
        got = chromium.evaluate("window.agoqPlanner.current.budget_bytes")
        assert chromium.evaluate("document.getElementById('plan-result').hidden") is False
        assert str(got) in chromium.evaluate("document.getElementById('plan-figures').textContent")
    step = (high - low) / 1000
    assert least <= got <= least + step + 1, (least, got, step)


def test_the_slider_starts_from_the_plan_made_from_the_profile(chromium, stage_root):
    """The demo's profile page: the first plan drawn is at the budget, and in the layout, of the plan the demo searched
    (--layout replicated) and trained, not in the layout the search would pick unasked."""
    from dashboard.app import create_app
    from dashboard.command import LOOPBACK_NAMES
    from experiments.service_load import serve

    trained = json.loads((stage_root / "demo/runs/plan/run.json").read_text())["plan"]
    drawn = "document.body.dataset.plansDrawn"
    with serve(create_app(stage_root, allowed_hosts=LOOPBACK_NAMES)) as (host, port):
        problems = chromium.open(f"http://{host}:{port}/profile?id=demo/profile", f"{drawn} === '1'")
        assert problems == [], problems
        current = json.loads(chromium.evaluate("JSON.stringify(window.agoqPlanner.current)"))
        assert current["budget_bytes"] == trained["budget_bytes"]
        assert current["plan"]["decision"]["knobs"]["layout"] == trained["decision"]["knobs"]["layout"] == "replicated"
        assert current["plan"]["launch"]["parallel"] == trained["launch"]["parallel"]
        assert chromium.evaluate("document.getElementById('plan-layout').value") == "replicated"
        # moving the slider keeps the layout chosen
        chromium.evaluate("(() => { const s = document.getElementById('plan-budget'); "
                          "s.value = 990; s.dispatchEvent(new Event('input')); })()")
        deadline = time.monotonic() + 30
        while chromium.evaluate(drawn) != "2":
            assert time.monotonic() < deadline, chromium.evaluate("document.getElementById('plan-status').textContent")
            time.sleep(0.1)
        moved = json.loads(chromium.evaluate("JSON.stringify(window.agoqPlanner.current)"))
        assert moved["budget_bytes"] > current["budget_bytes"]
        assert moved["plan"]["decision"]["knobs"]["layout"] == "replicated"
