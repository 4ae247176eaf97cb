"""A run with a plan against the plan's predictions (agoq.train.plan_check): the comparison run.json records, the
warnings, and what the search learns back from finished runs (`agoq search --runs`)."""

from __future__ import annotations

import json
import random
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from agoq.cli import main
from agoq.formats.profile import load_profile
from agoq.formats.run import measured_against_plan
from agoq.search.calibration import choice_of_plan
from agoq.search.costs import ProblemSettings, build_problem
from agoq.train.plan_check import CHECK_STEPS, STEP_TOLERANCE, PlanCheck


def _steady(seconds):
    """The second half of the steps (more than 4), else all but the first: written out here as the reference."""
    n = len(seconds)
    return [s for i, s in enumerate(seconds) if (i >= n // 2 if n > 4 else (i >= 1 or n == 1))]
from tests.search.synthetic_profile import write_profile


def _plan(peaks, step, budget, device=None, offload=()):
    return SimpleNamespace(predicted=SimpleNamespace(peak_bytes_per_stage=peaks, step_seconds=step),
                           budget_bytes=budget, source=SimpleNamespace(device=device),
                           layers=[SimpleNamespace(offload=o) for o in offload])


@pytest.mark.parametrize("over_budget", [False, True])
def test_report_against_an_independent_count(seed, over_budget):
    rng = random.Random(seed)
    predicted_peak = rng.randrange(10**9, 2 * 10**9)
    budget = predicted_peak + rng.randrange(1, 10**7)
    step = rng.uniform(0.05, 0.2)
    check = PlanCheck(_plan([predicted_peak], step, budget))
    seconds = [rng.uniform(0.5, 2.0)] + [step * rng.uniform(0.9, 1.1) for _ in range(rng.randrange(3, 17))]
    peaks = [rng.randrange(predicted_peak - 10**7, budget - 1) for _ in seconds]
    if over_budget:
        peaks[rng.randrange(len(peaks))] = budget + rng.randrange(1, 10**6)
    for s, p in zip(seconds, peaks):
        check.add(s, [p, None])
    r = check.report()
    assert r["steps"] == len(seconds) and r["first_step_peak_bytes"] == peaks[0]
    assert r["measured_peak_bytes"] == max(peaks)
    assert r["measured_step_seconds"] == pytest.approx(statistics.median(_steady(seconds)), rel=1e-12)
    assert r["peak_error"] == pytest.approx(max(peaks) / predicted_peak - 1, rel=1e-12)
    assert r["step_error"] == pytest.approx(statistics.median(_steady(seconds)) / step - 1, rel=1e-12)
    peak_warning = any("budget" in w for w in r["warnings"])
    assert peak_warning == over_budget
    step_warning = any("off the plan" in w for w in r["warnings"])
    assert step_warning == (abs(r["step_error"]) > STEP_TOLERANCE)


def test_a_plan_from_another_devices_profile_is_warned_about(seed):
    """A plan whose profile was measured on another device than the run's gets a warning (naming both, and the host
    link too where the plan offloads) in every report; the same device (any case and spacing), or either side unknown,
    gets none."""
    rng = random.Random(seed)
    names = ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "cpu"]
    theirs, mine = rng.sample(names, 2)
    offload = [rng.random() < 0.5 for _ in range(rng.randrange(2, 9))]
    check = PlanCheck(_plan([100], 1.0, 200, device=theirs, offload=offload), device=mine)
    warning = check.device_warning()
    assert warning is not None and theirs in warning and mine in warning
    assert ("host link" in warning) == any(offload)
    check.add(1.0, [150])
    r = check.report()
    assert r["plan_device"] == theirs and r["device"] == mine and r["warnings"] == [warning]
    same = "  " + theirs.upper() + " "
    for plan_device, run_device in ((theirs, same), (None, mine), (theirs, None)):
        check = PlanCheck(_plan([100], 1.0, 200, device=plan_device, offload=offload), device=run_device)
        check.add(1.0, [150])
        assert check.device_warning() is None and check.report()["warnings"] == [], (plan_device, run_device)


def test_peaks_that_are_no_allocator_figures_are_not_compared():
    check = PlanCheck(_plan([100], 1.0, 50), peaks=False)
    for _ in range(4):
        check.add(1.0, [10**9])
    r = check.report()
    assert r["measured_peak_bytes"] is None and not r["warnings"]
    assert check.due(min(CHECK_STEPS, 4), 4) and not check.due(2, 40) and check.due(CHECK_STEPS, 40)


@pytest.fixture()
def trained(tmp_path, seed):
    """A synthetic llama-tiny profile, a plan searched from it and a run of that plan on the CPU."""
    profile = write_profile(tmp_path / "profile", random.Random(seed), micro_batch=2, seq_len=32)
    problem = build_problem(load_profile(profile))
    sixteen = np.nonzero(problem.keeps_16bit())[0]
    roomy = max(problem.evaluate(sixteen, np.zeros(problem.num_layers, dtype=bool))["peak_bytes_per_stage"])
    assert main(["search", "--profile", str(profile), "--budget", str(roomy), "--out", str(tmp_path / "plan.json"),
                 "--quiet", "--front-budgets", "0", "--compile", "eager"]) == 0
    steps = 12
    assert main(["train", "llama-tiny", "--plan", str(tmp_path / "plan.json"), "--steps", str(steps), "--device",
                 "cpu", "--out", str(tmp_path / "run"), "--quiet", "--checkpoint-every", "0"]) == 0
    return profile, tmp_path / "plan.json", tmp_path / "run", steps


def test_a_run_records_itself_against_its_plan(trained):
    _, plan_path, run, steps = trained
    record = json.loads((run / "run.json").read_text())["plan_check"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seconds = [m["step_seconds"] for m in metrics if "step_seconds" in m]
    plan = json.loads(plan_path.read_text())
    assert record["steps"] == steps == len(seconds)
    assert record["measured_step_seconds"] == pytest.approx(statistics.median(_steady(seconds)), rel=1e-12)
    assert record["predicted_step_seconds"] == plan["predicted"]["step_seconds"]
    assert plan["source"]["device"] == "cpu" == record["plan_device"] == record["device"]  # a CPU profile, run
    assert not any("profile measured on" in w for w in record["warnings"])
    assert record["measured_peak_bytes"] is None  # the CPU's peak is no allocator figure


def test_the_search_learns_step_times_from_runs(trained):
    profile_dir, plan_path, run, _ = trained
    measured = measured_against_plan(run)
    plan = json.loads(plan_path.read_text())
    profile = load_profile(profile_dir)
    knobs = ProblemSettings(gradient_mode=plan["gradients"]["mode"], optimizer=plan["optimizer"]["name"],
                            master=plan["optimizer"]["master"], compile_mode=plan["training"]["compile"],
                            micro_batch=plan["training"]["micro_batch"], grad_accum=plan["training"]["grad_accum"])
    before = build_problem(profile, knobs)
    choice = choice_of_plan(before, plan)
    assert before.evaluate(*choice)["step_seconds"] == pytest.approx(plan["predicted"]["step_seconds"], rel=1e-9)
    loaded = load_profile(profile_dir)
    profile = loaded.with_runs([measured])
    assert loaded.runs == [] and profile.runs == [measured] and profile.cache is not loaded.cache  # explicit input
    after = build_problem(profile, knobs)
    # one run at that split: its plan is now predicted at what it measured
    assert after.evaluate(*choice)["step_seconds"] == pytest.approx(measured["step_seconds"], rel=1e-9)
    assert any("scaled by" in n for n in after.notes)


def test_runs_of_another_model_are_refused(trained, tmp_path, capsys):
    profile_dir, _, run, _ = trained
    other = write_profile(tmp_path / "other", random.Random(1), num_layers=5, micro_batch=2, seq_len=32)
    assert main(["search", "--profile", str(other), "--budget", "1GB", "--out", str(tmp_path / "p2.json"),
                 "--quiet", "--runs", str(run)]) == 2
    assert "trained another model" in capsys.readouterr().err
    assert main(["search", "--profile", str(profile_dir), "--budget", "1GB", "--out", str(tmp_path / "p3.json"),
                 "--quiet", "--runs", str(tmp_path / "profile")]) == 2
    assert "no run.json" in capsys.readouterr().err
