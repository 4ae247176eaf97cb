"""The GPU profiles agoq ships (agoq.examples) let a newcomer see offload: one of them measured the host link and the
offloading steps, and `agoq search` on it offloads at a budget where offloading is the fastest plan that fits."""

from __future__ import annotations

from agoq.cli import main
from agoq.examples import profiles
from agoq.formats.measured_steps import measured_rows
from agoq.formats.plan import load_plan
from agoq.formats.profile import load_profile
from agoq.search.request import InfeasibleBudget, KnobSpace
from agoq.search.search import plan_from_profile


def _with_link() -> dict:
    """The shipped profiles that measured the host link and at least one offloading step, by name."""
    out = {}
    for name, folder in profiles().items():
        profile = load_profile(folder)
        if profile.host_link and any(r.get("offload_layers") for r in measured_rows(profile.header)):
            out[name] = profile
    return out


def test_a_shipped_profile_measured_the_host_link():
    shipped = _with_link()
    assert "probe-h200" in shipped, sorted(profiles())
    link = shipped["probe-h200"].host_link
    assert link["d2h_bytes_per_second"] > 0 and link["h2d_bytes_per_second"] > 0 and link["pinnable_bytes"] > 0


def test_search_on_the_shipped_profile_offloads_where_that_is_fastest(tmp_path, capsys):
    """The budget is the peak the profile measured for its own offloading step (compiled agoq-paper with its layers
    offloaded, at the profiled micro-batch, one per step): there `agoq search` offloads a prefix of layers, fits the
    budget and pins no more than the host allows, and the best plan that keeps everything on the GPU is slower (or
    does not fit)."""
    profile = _with_link()["probe-h200"]
    micro_batch = profile.settings["micro_batch"]
    offloading = [r for r in measured_rows(profile.header) if r.get("offload_layers") and r["compile"] == "compiled"
                  and r["micro_batch"] == micro_batch and r["grad_accum"] == 1]
    assert offloading, "the profile measured no compiled offloading step at its micro-batch"
    budget = int(offloading[0]["peak_bytes"])
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(profile.path), "--budget", str(budget), "--out", str(out), "--quiet",
                 "--front-budgets", "0"]) == 0
    printed = capsys.readouterr().out
    plan = load_plan(out)
    offloaded = plan.offload_layers()
    assert offloaded and offloaded == list(range(len(offloaded)))
    assert max(plan.predicted.peak_bytes_per_stage) <= budget
    assert 0 < plan.predicted.host_bytes <= plan.host_budget_bytes == profile.host_link["pinnable_bytes"]
    assert any(line.strip().startswith("offload: layers 0-") for line in printed.splitlines())
    try:
        kept = plan_from_profile(profile, budget, space=KnobSpace(offload=False))
    except InfeasibleBudget:
        return  # nothing fits without offload: offload is the only plan, hence the fastest
    assert not kept.offload_layers()
    assert plan.predicted.step_seconds < kept.predicted.step_seconds
