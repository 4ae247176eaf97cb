"""`agoq profile`: a small run end to end, and clear errors (exit 2) on bad input."""

import json

import pandas as pd
import pytest

from agoq.cli import main

FAST = ["--quiet", "--bits", "4", "--formats", "int", "--batches", "1", "--seq-len", "13", "--micro-batch", "1"]


def tiny_factory():
    from agoq.models import build

    return build("llama-tiny", num_layers=2)


def not_a_module():
    return 42


def test_profile_with_budget_and_pipeline(tmp_path, capsys):
    out = tmp_path / "prof"
    code = main(["profile", "llama-tiny", *FAST, "--pipeline-stages", "3", "--micro-batches", "6", "--budget",
                 "64MiB", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "profile.json" in text and "plan.json" in text
    header = json.loads((out / "profile.json").read_text())
    assert header["pipeline"]["in_flight"]["1f1b"] == [3, 2, 1]
    table = pd.read_parquet(out / "profile.parquet")
    assert set(table.option) == {"16", "4", "recompute"} and len(table) == 3 * (7 * 2 + 3)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["schema"] == "agoq.plan/1.9" and plan["model"]["fingerprint"] == header["model"]["fingerprint"]
    assert len(plan["layers"]) == 3 and plan["budget_bytes"] == 64 * 1024 * 1024


def test_factory_model(tmp_path):
    out = tmp_path / "f"
    assert main(["profile", "tests.commands.test_profile:tiny_factory", *FAST, "--out", str(out)]) == 0
    assert json.loads((out / "profile.json").read_text())["model"]["num_layers"] == 2


def _error(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("model, message", [
    ("no-such-model", "unknown model"),
    ("tests.commands.test_profile:not_a_module", "not a torch nn.Module"),
    ("tests.commands.test_profile:missing", "has no function"),
    ("torch.nn:Identity", "no LLaMA-style decoder layers"),
])
def test_bad_models(tmp_path, capsys, model, message):
    code, err = _error(capsys, ["profile", model, *FAST, "--out", str(tmp_path / "x")])
    assert code == 2 and message in err


def test_bad_config_files(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, err = _error(capsys, ["profile", str(bad), *FAST])
    assert code == 2 and "not valid JSON" in err
    gpt = tmp_path / "gpt2.json"
    gpt.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    code, err = _error(capsys, ["profile", str(gpt), *FAST])
    assert code == 2 and "'gpt2' is not supported" in err
    code, err = _error(capsys, ["profile", str(tmp_path / "absent.json"), *FAST])
    assert code == 2 and "not found" in err


def test_more_layers_than_the_model_has_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """--layers above the model's own count would profile a larger model under its name: refused at once, for a
    preset and a config file (the same rule in `agoq activations` and `load_model`); the model's own count is
    fine."""
    import os
    import random

    import agoq.profiler.profile
    from agoq.runtime.activations.saved_bytes import find_decoder_layers
    from agoq.models import PRESETS
    from agoq.profiler.model_source import load_model

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    layers = rng.randint(2, 9)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**PRESETS["llama-tiny"].to_dict(), "num_hidden_layers": layers, "name": "mine"}))

    def no_work(*args, **kwargs):
        raise AssertionError("profiled before refusing --layers")

    monkeypatch.setattr(agoq.profiler.profile, "make_profile", no_work)
    for model, available in (("llama-tiny", PRESETS["llama-tiny"].num_hidden_layers), (str(config), layers)):
        asked = available + rng.randint(1, 96)
        code, err = _error(capsys, ["profile", model, *FAST, "--layers", str(asked), "--out", str(tmp_path / "p")])
        assert code == 2 and f"--layers {asked}: model {model} has {available} decoder layers" in err, (seed, err)
        code, err = _error(capsys, ["activations", model, "--quiet", "--layers", str(asked)])
        assert code == 2 and f"--layers {asked}:" in err and f"has {available} decoder layers" in err, (seed, err)
        with pytest.raises(ValueError, match=f"has {available} decoder layers"):
            load_model(model, num_layers=asked, device="meta")
        assert len(find_decoder_layers(load_model(model, num_layers=available, device="meta"))) == available
    assert not (tmp_path / "p").exists()


def test_bad_arguments(capsys):
    code, err = _error(capsys, ["profile", "llama-tiny", "--quiet", "--bits", "9"])
    assert code == 2 and "2..8" in err
    code, err = _error(capsys, ["profile", "llama-tiny", "--quiet", "--seq-len", "100000"])
    assert code == 2 and "max_position_embeddings" in err
    with pytest.raises(SystemExit) as e:
        main(["profile", "llama-tiny", "--batches", "0"])
    assert e.value.code == 2


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = capsys.readouterr().out
    for flag in ("--seq-len", "--micro-batch", "--dtype", "--device", "--bits", "--formats", "--batches", "--budget",
                 "--pipeline-stages", "--micro-batches", "--world-size", "--ray-address", "--ray", "--out", "--force"):
        assert flag in text


def gelu_llama():
    """A LLaMA-shaped model whose MLP declares a GELU activation (act_fn): not a SwiGLU layer."""
    import torch

    from agoq.models import build

    model = build("llama-tiny", num_layers=1)
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    return model


def test_unsupported_layer_is_refused_up_front(capsys):
    code, err = _error(capsys, ["profile", "tests.commands.test_profile:gelu_llama", *FAST])
    assert code == 2 and "SwiGLU" in err


def test_world_size_spawns_collectives(tmp_path, capfd):
    out = tmp_path / "w"
    assert main(["profile", "llama-tiny", *FAST, "--layers", "1", "--world-size", "2", "--collective-sizes",
                 "20KiB", "--out", str(out)]) == 0
    assert "collectives" not in capfd.readouterr().err  # --quiet: no bar, from the spawned processes either
    coll = pd.read_parquet(out / "collectives.parquet")
    assert set(coll.world_size) == {2} and set(coll.message_bytes) == {20 * 1024} and len(coll) == 9
    assert json.loads((out / "profile.json").read_text())["files"]["collectives"] == "collectives.parquet"


def test_resume_needs_a_profile_to_continue(tmp_path, capsys, monkeypatch):
    """--resume on a folder that does not exist, or holds no profile, is refused (exit 2, saying to drop --resume)
    instead of profiling afresh; nothing is made."""
    import agoq.profiler.profile

    def no_work(*args, **kwargs):
        raise AssertionError("profiled although --resume had nothing to continue")

    monkeypatch.setattr(agoq.profiler.profile, "make_profile", no_work)
    missing = tmp_path / "never-made"
    code, err = _error(capsys, ["profile", "llama-tiny", *FAST, "--resume", "--out", str(missing)])
    assert code == 2 and "does not exist" in err and "drop --resume" in err and not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("mine")
    code, err = _error(capsys, ["profile", "llama-tiny", *FAST, "--resume", "--out", str(empty)])
    assert code == 2 and "holds no profile" in err and "drop --resume" in err
    assert sorted(p.name for p in empty.iterdir()) == ["notes.txt"]


def test_out_holding_a_run_or_a_finished_profile_needs_force(tmp_path, capsys):
    """A training run's folder and a finished profile are refused (exit 2) and left as they were; --force writes
    the profile beside a run's files (kept), and replaces a profile, whose plan.json from an earlier --budget goes
    with it."""
    import os

    out = tmp_path / "run"
    out.mkdir()
    run_files = {"run.json": json.dumps({"schema": "agoq.run/1", "nonce": os.urandom(8).hex()}),
                 "metrics.jsonl": json.dumps({"step": 1, "loss": 5.5}) + "\n"}
    for name, text in run_files.items():
        (out / name).write_text(text)
    args = ["profile", "llama-tiny", *FAST, "--measured-steps", "0", "--out", str(out)]
    code, err = _error(capsys, args)
    assert code == 2 and "training run" in err and "run.json" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == sorted(run_files)

    assert main([*args, "--force", "--budget", "64MiB"]) == 0
    assert {name: (out / name).read_text() for name in run_files} == run_files  # the run's files are kept
    assert (out / "plan.json").is_file()
    for name in run_files:
        (out / name).unlink()
    made = (out / "profile.json").read_text()
    code, err = _error(capsys, args)
    assert code == 2 and "already holds a profile" in err and "--force" in err and "--resume" in err
    assert (out / "profile.json").read_text() == made and (out / "plan.json").is_file()

    assert main([*args, "--force", "--seed", "7"]) == 0
    assert json.loads(made)["settings"]["seed"] == 0
    assert json.loads((out / "profile.json").read_text())["settings"]["seed"] == 7  # made again
    assert not (out / "plan.json").exists()  # the replaced profile's plan, which this profile did not make
