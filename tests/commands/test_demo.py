"""`agoq demo`: what it prints (the GPU comparison first, the CPU check, closing lines that say which is which, the
dashboard command), the shipped profiles it copies, its budget rule and its loop's command lines. (The loop itself
runs once per session in the stage_root fixture; what --force replaces: test_demo_folder.py.)"""

import json
from pathlib import Path

import pytest

from agoq.cli import main
from agoq.commands import demo


def test_the_loop_gets_the_steps_and_the_record_and_the_closing_lines_say_which_is_which(monkeypatch, tmp_path,
                                                                                         capsys):
    calls = []
    monkeypatch.setattr(demo, "gpu_comparison", lambda: ["GPU HEADLINE"])
    monkeypatch.setattr(demo, "run_loop", lambda out, **kw: calls.append((out, kw)))
    assert main(["demo", "--out", str(tmp_path), "--steps", "7"]) == 0
    (out, kw), = calls
    assert out == tmp_path and kw["steps"] == 7 and kw["quiet"] is False and kw["record"].out == tmp_path
    printed = capsys.readouterr().out
    assert f"agoq dashboard --root {tmp_path.resolve()}" in printed
    closing = printed[printed.index("agoq demo: done"):]
    assert "on a GPU (predicted" in closing and "GPU HEADLINE" in closing and "on this CPU" in closing
    assert printed.index(demo.CPU_CHECK) < printed.index("agoq demo: done")
    assert json.loads((tmp_path / "agoq-demo.json").read_text())["finished"] is True


def test_force_says_what_it_replaces():
    from agoq.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["demo"]
    text = " ".join(next(a for a in sub._actions if a.dest == "force").help.split())
    assert "agoq-demo.json" in text and "left alone" in text and "refuse" in text


def test_a_cpu_run_records_its_step_against_the_plan_without_a_warning(seed):
    """On the CPU agoq's quantization runs as its reference code and the step model does not describe it: the step
    is recorded, not warned about; the same step on a GPU is warned about."""
    import random
    from types import SimpleNamespace

    from agoq.train.plan_check import STEP_TOLERANCE, PlanCheck

    rng = random.Random(seed)
    predicted = rng.uniform(0.01, 0.2)
    measured = predicted * (1 + rng.choice([-1, 1]) * rng.uniform(2 * STEP_TOLERANCE, 1.5))
    plan = SimpleNamespace(predicted=SimpleNamespace(peak_bytes_per_stage=[100], step_seconds=predicted),
                           budget_bytes=200, source=SimpleNamespace(device=None), layers=[])
    for device, warned in (("cpu", False), (" CPU ", False), ("NVIDIA H200", True)):
        check = PlanCheck(plan, device=device)
        for _ in range(6):
            check.add(measured, [None])
        report = check.report()
        assert report["step_error"] == pytest.approx(measured / predicted - 1, rel=1e-9)
        assert any("off the plan" in w for w in report["warnings"]) == warned, device


def test_the_demo_root_holds_the_example_profiles_and_they_plan(monkeypatch, tmp_path, capsys):
    """The shipped GPU profiles land beside the demo's own, load, and the search plans from them on this machine
    (the dashboard lists and plans from them the same way)."""
    from agoq.examples import profiles
    from agoq.formats.profile import load_profile
    from agoq.search.knobs import budget_bounds

    monkeypatch.setattr(demo, "run_loop", lambda out, **kw: None)
    assert main(["demo", "--out", str(tmp_path)]) == 0
    shipped = profiles()
    assert shipped and sorted(p.name for p in (tmp_path / "examples").iterdir()) == sorted(shipped)
    printed = capsys.readouterr().out
    assert f"--profile {tmp_path.resolve() / 'examples'}" in printed
    _check_the_gpu_comparison(printed, shipped)
    for name in shipped:
        profile = load_profile(tmp_path / "examples" / name)
        assert profile.settings["device"].startswith("cuda")
        least, _ = budget_bounds(profile)
        plan = tmp_path / f"{name}.json"
        assert main(["search", "--profile", str(tmp_path / "examples" / name), "--budget", str(int(least * 1.2)),
                     "--out", str(plan), "--quiet", "--front-budgets", "0"]) == 0
        assert json.loads(plan.read_text())["predicted"]["peak_bytes_per_stage"][0] <= int(least * 1.2)


def _check_the_gpu_comparison(printed: str, shipped: dict) -> None:
    """The GPU comparison leads, before the CPU check: per shipped profile, the budgets read off its profile.json
    (0.9x and 1x agoq-paper's predicted peak, halfway to bf16's), each with agoq's plan and what runs without agoq,
    and the ratio printed is the ratio of the tokens/s printed."""
    import re

    gpu = printed[:printed.index(demo.CPU_CHECK)]
    for name, folder in shipped.items():
        steps = {s["policy"]: s["predicted_peak_bytes"] for s in json.loads((folder / "profile.json").read_text())[
            "memory"]["steps"]}
        part = gpu[gpu.index(f"(shipped profile {name})"):]
        part = part[:part.index("(shipped profile", 1)] if "(shipped profile" in part[1:] else part
        paper, bf16 = steps["agoq-paper"], steps["bf16"]
        for budget in (int(0.9 * paper), paper, int((paper + bf16) / 2)):
            at = f"at {budget / 1e9:.1f} GB"
            assert at in part, (at, part)
            block = part[part.index(at):].splitlines()[:2]
            assert any("agoq's plan" in line for line in block) and any("without agoq" in line for line in block)
            ratio = re.search(r"agoq's plan\s+([\d,]+) tokens/s.*\n.*without agoq\s+([\d,]+) tokens/s.*: agoq's plan "
                              r"([\d.]+)x", "\n".join(block))
            if ratio:
                mine, theirs, said = (float(g.replace(",", "")) for g in ratio.groups())
                assert said == pytest.approx(mine / theirs, abs=0.011)
    assert "docs/results.md" in gpu


def test_budget_is_the_paper_recipes_peak(tmp_path):
    steps = [{"policy": "bf16", "predicted_peak_bytes": 5_000_123}, {"policy": "agoq-paper", "predicted_peak_bytes": 3_100_017}]
    (tmp_path / "profile.json").write_text(json.dumps({"schema": "agoq.profile/1", "memory": {"steps": steps}}))
    assert demo.demo_budget(tmp_path) == 3_100_017
    (tmp_path / "profile.json").write_text(json.dumps({"schema": "agoq.profile/1", "memory": {"steps": steps[:1]}}))
    try:
        demo.demo_budget(tmp_path)
    except ValueError as e:
        assert "agoq-paper" in str(e)
    else:
        raise AssertionError("a profile without the paper recipe's peak must be refused")


@pytest.mark.parametrize("sharded", [{"gradients": {"mode": "sdp4bit"}},
                                     {"gradients": {"mode": "bf16"}, "launch": {"processes": 2, "parallel": "fsdp"}}])
def test_loop_order_and_sharded_plan_on_one_process(monkeypatch, tmp_path, sharded):
    """The loop's command lines: profile, search at the paper recipe's peak, then two runs on the plan's
    batch shape; a plan sharded over several processes (FSDP2 with TLq-HS or with bf16 gradients) cannot train in
    one, so the plan searched replicated with quangrad8 at the same budget is the one trained (agoq train
    refuses flags that contradict a plan)."""
    calls = []

    def fake_stage(argv):
        calls.append(argv)
        out = argv[argv.index("--out") + 1]
        if argv[0] == "profile":
            steps = [{"policy": "bf16", "predicted_peak_bytes": 9_000_001},
                     {"policy": "agoq-paper", "predicted_peak_bytes": 4_000_003}]
            (tmp_path / "d" / "profile").mkdir(parents=True)
            (tmp_path / "d" / "profile" / "profile.json").write_text(json.dumps({"memory": {"steps": steps}}))
        if argv[0] == "search":
            plan = ({"gradients": {"mode": "quangrad8"}, "training": {"seq_len": 47, "micro_batch": 5, "grad_accum": 2}}
                    if "--gradients" in argv else
                    {**sharded, "training": {"seq_len": 48, "micro_batch": 3}})
            Path(out).parent.mkdir(parents=True)
            with open(out, "w") as f:
                json.dump(plan, f)

    monkeypatch.setattr(demo, "_stage", fake_stage)
    demo.run_loop(tmp_path / "d", steps=9, quiet=True)
    assert [c[0] for c in calls] == ["profile", "search", "search", "train", "train"]
    assert calls[1][calls[1].index("--budget") + 1] == "4000003"
    assert calls[2][calls[2].index("--budget") + 1] == "4000003"
    assert calls[2][calls[2].index("--gradients") + 1] == "quangrad8"
    assert calls[2][calls[2].index("--layout") + 1] == "replicated"
    one_process = str(tmp_path / "d" / "search-one-process" / "plan.json")
    assert calls[2][calls[2].index("--out") + 1] == one_process
    for run in calls[3:]:  # the one-process plan's batch shape (5 x 2 of 47 tokens)
        assert run[run.index("--seq-len") + 1] == "47" and run[run.index("--micro-batch") + 1] == "5"
        assert run[run.index("--grad-accum") + 1] == "2" and run[run.index("--steps") + 1] == "9"
    assert "--gradients" not in calls[3] and "--plan" not in calls[3]
    assert "--gradients" not in calls[4] and calls[4][calls[4].index("--plan") + 1] == one_process
