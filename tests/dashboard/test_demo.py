"""`agoq demo`: clear refusal when a stage is missing or an earlier demo is in the way, the command it
prints, and its budget rule. (The loop itself runs once per session in the stage_root fixture.)"""

import importlib.util
import json

from agoq import demo
from agoq.cli import main


def test_missing_stage_is_named(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "agoq.search.command" else real(name, *a))
    assert demo.missing_stages() == ["search"]
    assert main(["demo", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "agoq search" in err and "agoq.search.command" in err
    assert not (tmp_path / "d" / "profile").exists()


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
