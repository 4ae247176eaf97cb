"""`agoq profile --compile`: the profile's "compiled" section, and the search planning from it."""

import json

import pytest

from agoq.cli import main
from agoq.formats.profile import load_profile
from agoq.search.costs import compile_modes

ARGS = ["profile", "llama-tiny", "--device", "cpu", "--seq-len", "29", "--micro-batch", "2", "--bits", "4",
        "--formats", "int", "--batches", "1", "--quiet"]


@pytest.fixture()
def fast_compile(monkeypatch):
    """Each decoder layer compiled with the aot_eager backend: the same graphs as Inductor's input, in seconds."""
    from agoq.activations import compile as compile_module
    from agoq.profiler import compiled

    real = compile_module.compile_decoder_layers
    monkeypatch.setattr(compiled, "compile_decoder_layers", lambda model, **kw: real(model, backend="aot_eager", **kw))


def test_compile_writes_the_section_and_the_search_plans_compiled(tmp_path, fast_compile):
    from agoq.search.knobs import KnobSpace
    from agoq.search.search import search

    assert main([*ARGS, "--out", str(tmp_path / "p"), "--compile"]) == 0
    header = json.loads((tmp_path / "p" / "profile.json").read_text())
    section = header["compiled"]
    assert [s["policy"] for s in section["steps"]] == ["bf16", "agoq-paper", "checkpoint-all"]
    assert [p["activation_memory_budget"] for p in section["memory_budget_points"]] == [0.5, 0.1]
    assert [m["micro_batch"] for m in section["micro_batch_steps"]] == [1]
    for row in section["steps"] + section["memory_budget_points"] + section["micro_batch_steps"]:
        assert 0 < row["optimizer_step_seconds"] < row["step_seconds"]
    assert header["seconds"]["compiled"] > 0 and not header["failures"]
    profile = load_profile(tmp_path / "p")
    assert "compiled" in compile_modes(profile)
    budget = 10**9
    plan = search(profile, budget, front_budgets=0, progress=False,
                  space=KnobSpace(compile_modes=("compiled",))).plan
    assert plan.training.compile == "compiled" and max(plan.predicted.peak_bytes_per_stage) <= budget


def test_no_compile_and_the_cpu_default_write_none(tmp_path):
    assert main([*ARGS, "--out", str(tmp_path / "a"), "--no-compile"]) == 0
    assert main([*ARGS, "--out", str(tmp_path / "b")]) == 0  # the default on the CPU
    for name in ("a", "b"):
        header = json.loads((tmp_path / name / "profile.json").read_text())
        assert "compiled" not in header and "compiled" not in header["seconds"]
        assert compile_modes(load_profile(tmp_path / name)) == ["eager"]
