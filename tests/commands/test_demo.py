"""`agoq demo`: clear refusal when an earlier demo is in the way, the command it
prints, and its budget rule. (The loop itself runs once per session in the stage_root fixture.)"""

import json
from pathlib import Path

import pytest

from agoq.cli import main
from agoq.commands import demo


def test_earlier_demo_needs_force(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(demo, "run_loop", lambda out, **kw: calls.append((out, kw)))
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "old").write_text("x")
    (tmp_path / "mine.txt").write_text("keep")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err and not calls
    assert main(["demo", "--out", str(tmp_path), "--force", "--steps", "7"]) == 0
    assert calls == [(tmp_path, {"steps": 7, "quiet": False})]
    assert not (tmp_path / "profile").exists() and (tmp_path / "mine.txt").read_text() == "keep"
    out = capsys.readouterr().out
    assert f"agoq dashboard --root {tmp_path.resolve()}" in out


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
    assert "examples" in capsys.readouterr().err
    for name in shipped:
        profile = load_profile(tmp_path / "examples" / name)
        assert profile.settings["device"].startswith("cuda")
        least, _ = budget_bounds(profile)
        plan = tmp_path / f"{name}.json"
        assert main(["search", "--profile", str(tmp_path / "examples" / name), "--budget", str(int(least * 1.2)),
                     "--out", str(plan), "--quiet", "--front-budgets", "0"]) == 0
        assert json.loads(plan.read_text())["predicted"]["peak_bytes_per_stage"][0] <= int(least * 1.2)


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
    batch shape; a plan sharded over several processes (SDP4Bit, or FSDP2 with bf16 gradients) cannot train in
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
