"""`agoq train` in one process: run folder contents, exact resume after a kill, 8-bit paths, bad inputs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agoq.cli import main
from agoq.train import trainer as trainer_module
from agoq.train.checkpoint import find_checkpoint
from agoq.train.trainer import TrainConfig, train

TINY = dict(model="llama-tiny", seq_len=32, micro_batch=2, eval_batches=2, quiet=True)


def _metrics(run_dir):
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "loss" in x], [x for x in lines if "val_loss" in x]


def _run_json(run_dir):
    return json.loads(Path(run_dir, "run.json").read_text())


def test_run_folder_follows_the_run_format(tmp_path):
    out = tmp_path / "run"
    assert train(TrainConfig(**TINY, steps=7, grad_accum=2, checkpoint_every=3, eval_every=3, out=str(out))) == 0
    run = _run_json(out)
    assert run["schema"] == "agoq.run/1" and run["status"] == "finished" and run["step"] == 7
    assert run["plan"] is None and run["settings"]["parallel"] == "none" and run["settings"]["data"] == "synthetic"
    assert run["model"]["fingerprint"] and run["world"]["size"] == 1
    steps, vals = _metrics(out)
    assert [m["step"] for m in steps] == list(range(1, 8))
    assert [v["step"] for v in vals] == [3, 6, 7]
    for m in steps:
        assert set(m) >= {"loss", "grad_norm", "lr", "tokens_per_s", "step_seconds", "peak_bytes",
                          "peak_reserved_bytes", "time"}
        assert len(m["peak_bytes"]) == 1 and m["tokens_per_s"] > 0
        assert m["peak_reserved_bytes"] is None  # a CPU run: the allocator's reserved bytes are the GPU's
    assert steps[-1]["loss"] < steps[0]["loss"]  # it learns
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert latest == {"schema": "agoq.checkpoint/2", "step": 7, "folder": "step-00000007"}
    folder = out / "checkpoints" / "step-00000007"
    info = json.loads((folder / "agoq.json").read_text())
    assert info["step"] == 7 and info["world"] == 1 and (folder / ".metadata").is_file()
    assert list(folder.glob("*.distcp"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest.json", "step-00000007"]


def test_checkpoint_every_0_writes_no_checkpoint_and_master_none_is_recorded(tmp_path):
    out = tmp_path / "run"
    assert train(TrainConfig(**TINY, steps=3, checkpoint_every=0, dtype="bf16", optimizer="adamw8bit",
                             gradients="quangrad8", master="none", out=str(out))) == 0
    assert not (out / "checkpoints").exists()
    run = _run_json(out)
    assert run["status"] == "finished" and run["settings"]["master"] == "none"
    assert run["settings"]["optimizer"] == "adamw8bit" and run["settings"]["gradients"] == "quangrad8"
    with pytest.raises(ValueError, match="--master none"):
        train(TrainConfig(**TINY, steps=1, master="none", out=str(tmp_path / "bad")))


class _Killed(BaseException):
    """Stands for a kill: nothing in the trainer catches it."""


@pytest.mark.parametrize("variant", [dict(), dict(dtype="bf16", optimizer="adamw8bit"),  # bf16: float32 masters
                                     dict(dtype="bf16", optimizer="adamw8bit", master="none", gradients="quangrad8")])
def test_resume_after_interruption_gives_the_same_losses_exactly(tmp_path, monkeypatch, variant):
    common = dict(**TINY, steps=9, grad_accum=2, checkpoint_every=4, eval_every=3, **variant)
    assert train(TrainConfig(**common, out=str(tmp_path / "whole"))) == 0

    original = trainer_module.Trainer._forward_backward

    def dying(self, step):
        if step == 6:
            raise _Killed()
        return original(self, step)

    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward", dying)
    with pytest.raises(_Killed):
        train(TrainConfig(**common, out=str(tmp_path / "cut")))
    assert find_checkpoint(tmp_path / "cut")[1]["step"] == 4
    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward", original)
    assert train(TrainConfig(**common, out=str(tmp_path / "cut"), resume=True)) == 0
    whole, cut = _metrics(tmp_path / "whole"), _metrics(tmp_path / "cut")
    assert [m["loss"] for m in cut[0]] == [m["loss"] for m in whole[0]]
    assert [m["grad_norm"] for m in cut[0]] == [m["grad_norm"] for m in whole[0]]
    assert [v["val_loss"] for v in cut[1]] == [v["val_loss"] for v in whole[1]]
    run = _run_json(tmp_path / "cut")
    assert run["status"] == "finished" and run["resumed"][0]["step"] == 4


def _cli(*args):
    return [sys.executable, "-m", "agoq.cli", "train", "llama-tiny", "--seq-len", "32", "--micro-batch", "2",
            "--eval-batches", "2", "--quiet", "--device", "cpu", *args]


def test_killed_process_resumes_exactly(tmp_path):
    """A real process killed with SIGKILL mid-run, then --resume: the same losses as an uninterrupted run."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    args = ["--steps", "16", "--checkpoint-every", "3", "--eval-every", "5", "--optimizer", "adamw8bit",
            "--policy", "agoq-paper", "--gradients", "quangrad8"]
    cut = tmp_path / "cut"
    proc = subprocess.Popen(_cli(*args, "--out", str(cut)), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = cut / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 8:  # mid-run, between checkpoints or not
            break
        if proc.poll() is not None:
            pytest.fail(f"training ended before it could be killed: {proc.stderr.read().decode()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    killed_at = len([x for x in (cut / "metrics.jsonl").read_text().splitlines() if '"loss"' in x])
    assert killed_at < 16, "the run finished before the kill"
    assert _run_json(cut)["status"] == "running"  # nothing got to say otherwise
    done = subprocess.run(_cli(*args, "--out", str(cut), "--resume"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    whole = tmp_path / "whole"
    assert train(TrainConfig(**TINY, steps=16, checkpoint_every=3, eval_every=5, optimizer="adamw8bit",
                             policy="agoq-paper", gradients="quangrad8", out=str(whole))) == 0
    assert [m["loss"] for m in _metrics(cut)[0]] == [m["loss"] for m in _metrics(whole)[0]]
    assert [v["val_loss"] for v in _metrics(cut)[1]] == [v["val_loss"] for v in _metrics(whole)[1]]


def test_non_finite_loss_fails_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--quiet", "--steps", "40",
                 "--lr", "1e6", "--warmup", "0", "--clip", "0", "--checkpoint-every", "1", "--out", str(out)])
    assert code == 1
    run = _run_json(out)
    assert run["status"] == "failed" and "not finite" in run["message"]
    assert "not finite" in capsys.readouterr().err
    steps, _ = _metrics(out)
    _, state = find_checkpoint(out)
    assert state["step"] == len(steps) == run["step"]  # every logged step was good and checkpointed
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in steps)


def _tiny_plan(tmp_path, model_spec="llama-tiny", **gradients):
    from agoq.formats.plan import Plan
    from agoq.models import build, fingerprint

    model = build(model_spec)
    layers = [{"layer": i, "stage": 0, "checkpoint": i == 2,
               "kinds": {} if i == 2 else {"norm_input": 4, "qkv_input": "recompute", "silu_input": 5}}
              for i in range(model.config.num_hidden_layers)]
    plan = Plan.model_validate({"schema": "agoq.plan/1", "model": {"name": model.config.name,
                                                                   "fingerprint": fingerprint(model)},
                                "layers": layers, "gradients": {"mode": "quangrad8", **gradients},
                                "training": {"micro_batch": 3, "seq_len": 24, "grad_accum": 2}})
    return plan.save(tmp_path / "plan.json")


def test_plan_sets_activations_gradients_and_batch_shape(tmp_path):
    plan = _tiny_plan(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "llama-tiny", "--plan", str(plan), "--steps", "3", "--quiet", "--out", str(out)]) == 0
    run = _run_json(out)
    assert run["plan"]["gradients"]["mode"] == "quangrad8" and run["settings"]["gradients"] == "quangrad8"
    assert (run["settings"]["micro_batch"], run["settings"]["seq_len"], run["settings"]["grad_accum"]) == (3, 24, 2)


def test_bad_inputs_are_refused_before_training(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
                                 "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
                                 "max_position_embeddings": 128, "name": "other"}))
    plan = _tiny_plan(tmp_path)
    binary = tmp_path / "tokenizer.json"
    binary.write_bytes(os.urandom(3000) + b"\xff\xfe")  # no UTF-8 (0xff never is)
    cases = [
        (["llama-tiny", "--data", str(tmp_path / "missing.txt")], "data file not found"),
        (["llama-tiny", "--tokenizer", str(binary)], f"--tokenizer {binary} is not a HuggingFace tokenizers JSON"),
        (["llama-tiny", "--tokenizer", str(tmp_path)], f"--tokenizer {tmp_path} is a folder"),
        (["llama-tiny", "--policy", str(binary)], f"policy file {binary} is not valid JSON"),
        ([str(other), "--plan", str(plan)], "made for model 'llama-tiny'"),
        (["llama-tiny", "--plan", str(tmp_path / "nope.json")], "plan file not found"),
        (["llama-tiny", "--parallel", "ddp"], "needs several processes"),
        (["llama-tiny", "--seq-len", "4096"], "max_position_embeddings"),
        (["llama-tiny", "--policy", "int3"], "unknown activation policy"),
        (["llama-tiny", "--gradients", "sdp4bit"], "use --parallel fsdp or hsdp"),
    ]
    for args, message in cases:
        out = tmp_path / "never"
        code = main(["train", *args, "--steps", "2", "--quiet", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
        assert not (out / "metrics.jsonl").exists()
    # agoq's retired own sharded mode: argparse's usage error (exit 2) saying what runs instead
    with pytest.raises(SystemExit) as e:
        main(["train", "llama-tiny", "--parallel", "sharded", "--quiet", "--out", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "own sharded path" in err and "retired" in err, err
    assert "--parallel fsdp --gradients sdp4bit --weight-gather int4 --node-size 1" in err, err
    # a run folder that already holds a run needs --resume
    out = tmp_path / "run"
    assert main(["train", "llama-tiny", "--seq-len", "16", "--steps", "1", "--quiet", "--out", str(out)]) == 0
    assert main(["train", "llama-tiny", "--seq-len", "16", "--steps", "2", "--quiet", "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    # resuming with other settings is refused
    assert main(["train", "llama-tiny", "--seq-len", "24", "--steps", "2", "--quiet", "--out", str(out),
                 "--resume"]) == 2
    assert "seq_len 16 -> 24" in capsys.readouterr().err


def test_plan_over_the_gpu_memory_is_refused(tmp_path, monkeypatch):
    """The budget check compares the plan's predicted peak with the device memory (faked here: no GPU in CI)."""
    from agoq.formats.plan import load_plan
    from agoq.train.device import check_budget

    plan = load_plan(_tiny_plan(tmp_path))
    plan.predicted.peak_bytes_per_stage = [200 * 2**30]

    class Props:
        total_memory = 141 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a 141 GiB GPU")
    with pytest.raises(ValueError, match="predicted peak is 200.0 GiB but this GPU"):
        check_budget(plan, None, trainer_module.World(), torch.device("cuda", 0), "plan.json")
    plan.predicted.peak_bytes_per_stage = [100 * 2**30]
    check_budget(plan, None, trainer_module.World(), torch.device("cuda", 0), "plan.json")


def test_text_file_bytes_and_vocabulary_override(tmp_path):
    text = tmp_path / "corpus.txt"
    raw = ("To be, or not to be, that is the question. " * 200).encode()
    text.write_bytes(raw)
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                                 "max_position_embeddings": 128, "name": "small"}))
    out = tmp_path / "run"
    assert train(TrainConfig(model=str(small), data=str(text), seq_len=32, micro_batch=2, steps=2, quiet=True,
                             out=str(out))) == 0
    run = _run_json(out)
    assert run["model"]["config"]["vocab_size"] == 256 and run["model"]["vocab_overridden"]
    n_val = round(len(raw) * 0.1)  # 90/10, validation at the end
    assert run["settings"]["train_tokens"] == len(raw) - n_val and run["settings"]["val_tokens"] == n_val


def test_policy_run_records_its_policy_as_a_valid_plan(tmp_path):
    from agoq.formats.plan import plan_from_dict

    out = tmp_path / "run"
    assert main(["train", "llama-tiny", "--policy", "agoq-paper", "--gradients", "quangrad8", "--seq-len", "16",
                 "--steps", "1", "--quiet", "--out", str(out)]) == 0
    recorded = plan_from_dict(_run_json(out)["plan"])
    assert recorded.source.method == "policy" and recorded.source.objective == "agoq-paper"
    assert recorded.gradients.mode == "quangrad8" and recorded.settings(1)["silu_input"] == 4
    assert recorded.settings(0)["qkv_input"] == "recompute" and recorded.training.seq_len == 16


def test_tokenizers_json_sets_the_vocabulary(tmp_path):
    """A HuggingFace tokenizers file: its vocabulary (here 300 > llama-tiny's 256) is what the model gets."""
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(297)]
    vocab = {"[UNK]": 0, " ": 1, "\n": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    g = torch.Generator().manual_seed(3)
    text = tmp_path / "words.txt"
    text.write_text(" ".join(words[int(i)] for i in torch.randint(0, 297, (3000,), generator=g)))
    out = tmp_path / "run"
    assert train(TrainConfig(model="llama-tiny", data=str(text), tokenizer=str(path), seq_len=32, micro_batch=2,
                             steps=2, quiet=True, out=str(out))) == 0
    run = _run_json(out)
    assert run["settings"]["tokenizer"] == str(path) and run["model"]["config"]["vocab_size"] == 300
    assert run["settings"]["train_tokens"] + run["settings"]["val_tokens"] == 3000
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        train(TrainConfig(model="llama-tiny", tokenizer=str(tmp_path / "none.json"), out=str(tmp_path / "x")))


def test_sigterm_marks_the_run_stopped(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    args = ["--steps", "400", "--checkpoint-every", "2", "--out", str(out)]
    proc = subprocess.Popen(_cli(*args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoints" / "latest.json").exists():
        if proc.poll() is not None:
            pytest.fail(proc.stderr.read().decode())
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    proc.stderr.close()
    run = _run_json(out)
    assert run["status"] == "stopped" and "--resume" in run["message"]
    assert run["step"] < 400


_QWEN2_TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 40,
               "intermediate_size": 72, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
               "use_sliding_window": False, "sliding_window": 32, "max_window_layers": 2,
               "tie_word_embeddings": True, "attention_dropout": 0.0, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("extra", [[], ["--policy", "agoq-paper"]])
def test_qwen2_config_trains(tmp_path, extra):
    config = tmp_path / "qwen2-tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(_QWEN2_TINY))
    out = tmp_path / "run"
    assert main(["train", str(config), "--steps", "2", "--seq-len", "16", "--micro-batch", "2", "--quiet",
                 "--out", str(out), *extra]) == 0
    run = _run_json(out)
    assert run["status"] == "finished" and run["step"] == 2
    assert run["model"]["config"]["model_type"] == "qwen2"
    steps, _ = _metrics(out)
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in steps)


def test_llama3_scaled_and_mistral_configs(tmp_path, capsys):
    llama3 = {**_QWEN2_TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16}}
    mistral = {**_QWEN2_TINY, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
               "sliding_window": 32}  # a window shorter than max_position_embeddings (64)
    for name, d in (("llama3", llama3), ("mistral", mistral)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    out = tmp_path / "run"
    assert main(["train", str(tmp_path / "llama3.json"), "--steps", "2", "--seq-len", "16", "--quiet",
                 "--out", str(out)]) == 0
    assert _run_json(out)["model"]["config"]["rope_scaling"]["rope_type"] == "llama3"
    assert main(["train", str(tmp_path / "mistral.json"), "--steps", "2", "--quiet",
                 "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "sliding_window 32" in err and "max_position_embeddings (64)" in err


def test_a_sharded_plan_says_how_to_launch_it(tmp_path, capsys):
    """A plan searched on a several-rank profile for SDP4Bit's gradients (FSDP2 with TLq-HS) names its launch; one
    process refuses it with it."""
    from agoq.search.plan_builder import launch_for

    def how(launch):
        return launch["processes"], launch["parallel"], launch["command"]

    torchrun = "torchrun --nproc-per-node {} -m agoq.train MODEL --plan PLAN.json --parallel {}"
    assert how(launch_for(1, "sdp4bit", 3)) == (3, "fsdp", torchrun.format(3, "fsdp") + " --gradients sdp4bit")
    assert how(launch_for(4, "bf16", 1)) == (4, "pipeline", torchrun.format(4, "pipeline"))
    assert how(launch_for(1, "quangrad8", 2)) == (2, "ddp", torchrun.format(2, "ddp"))
    assert how(launch_for(1, "bf16", 1)) == (1, "none", "agoq train MODEL --plan PLAN.json")
    path = _tiny_plan(tmp_path)
    data = json.loads(path.read_text())
    data["gradients"]["mode"] = "sdp4bit"
    data["launch"] = launch_for(1, "sdp4bit", 3)
    path.write_text(json.dumps(data))
    assert main(["train", "llama-tiny", "--plan", str(path), "--steps", "1", "--quiet",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 3" in err and "--parallel fsdp --gradients sdp4bit" in err


def test_offloaded_run_trains_as_the_kept_one_and_says_what_moved(tmp_path):
    """--offload copies what the layers keep to host memory and back: the same losses as the run without it; run.json
    records the layers and the bytes moved."""
    common = dict(TINY, seq_len=131, micro_batch=4, grad_accum=2, steps=3, checkpoint_every=0)  # tensors past 64 KiB
    assert train(TrainConfig(**common, out=str(tmp_path / "kept"))) == 0
    assert train(TrainConfig(**common, offload="0-1", out=str(tmp_path / "off"))) == 0
    kept, off = _metrics(tmp_path / "kept")[0], _metrics(tmp_path / "off")[0]
    assert [m["loss"] for m in off] == [m["loss"] for m in kept]
    run = _run_json(tmp_path / "off")
    assert run["settings"]["offload"] == [0, 1] and run["settings"]["host_budget_gb"] is None
    moved = run["offload"]
    assert moved["offloaded_bytes"] > 0 and set(moved["bytes_per_layer"]) == {"0", "1"}
    assert moved["micro_batches"] == 5  # 3 steps x 2 micro-batches, the pool emptied before each but the first


@pytest.mark.parametrize("flags,match", [(dict(offload="0-7"), "out of range"),
                                         (dict(offload="first"), "no layer index"),
                                         (dict(host_budget=2 * 10**9), "give --offload too"),
                                         (dict(offload="all", host_budget=0), "positive number of bytes"),
                                         (dict(offload="all", host_budget=2.5), "positive number of bytes")])
def test_bad_offload_settings_are_refused(tmp_path, flags, match):
    with pytest.raises(ValueError, match=match):
        train(TrainConfig(**TINY, steps=1, out=str(tmp_path / "run"), **flags))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
