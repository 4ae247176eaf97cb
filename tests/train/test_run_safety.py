"""Runs that lose or mix no work: a checkpoint where a signal stops the run, one writer per run folder,
no silent change of settings on resume, and a heartbeat that tells a killed run from a live one."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agoq.cli import main
from agoq.formats.run import RunRecord
from agoq.train import trainer as trainer_module
from agoq.train.checkpoint import find_checkpoint
from agoq.train.stopping import RunFolderBusy, RunLock
from agoq.train.trainer import TrainConfig, train

TINY = dict(model="llama-tiny", seq_len=32, micro_batch=2, eval_batches=2, quiet=True)
ENV = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}


def _lines(run_dir):
    return [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir):
    lines = _lines(run_dir)
    return [x["loss"] for x in lines if "loss" in x], [x["val_loss"] for x in lines if "val_loss" in x]


def _run_json(run_dir):
    return json.loads(Path(run_dir, "run.json").read_text())


def _cli(*args):
    return [sys.executable, "-m", "agoq.cli", "train", "llama-tiny", "--seq-len", "32", "--micro-batch", "2",
            "--eval-batches", "2", "--quiet", "--device", "cpu", *args]


def _wait_for_steps(proc, out, n, timeout=120):
    """Wait until the process at `out` has logged `n` training steps."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and sum('"loss"' in x for x in metrics.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"training ended early: {proc.stderr.read().decode()}")
        time.sleep(0.02)
    pytest.fail("training did not get going")


# ------------------------------------------------------------------------------------------ signals


def test_sigterm_saves_a_checkpoint_at_the_step_boundary_and_resume_is_exact(tmp_path):
    """A process sent SIGTERM mid-run checkpoints the step it finished; --resume gives an uninterrupted run's losses."""
    steps = 60
    args = ["--steps", str(steps), "--checkpoint-every", "25", "--eval-every", "4", "--warmup", "3"]
    cut = tmp_path / "cut"
    proc = subprocess.Popen(_cli(*args, "--out", str(cut)), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _wait_for_steps(proc, cut, 5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130, proc.stderr.read().decode()
    proc.stderr.close()
    stopped_at = len(_losses(cut)[0])
    assert stopped_at < steps, "the run finished before the signal"
    _, state = find_checkpoint(cut)
    run = _run_json(cut)
    assert state["step"] == stopped_at == run["step"]  # no step lost, none half-logged
    assert run["status"] == "stopped" and f"checkpoint saved at step {stopped_at}" in run["message"]
    assert "SIGTERM" in run["message"] and "--resume" in run["message"]
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["latest.json", f"step-{stopped_at:08d}"]
    done = subprocess.run(_cli(*args, "--out", str(cut), "--resume"), env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    whole = tmp_path / "whole"
    assert train(TrainConfig(**TINY, steps=steps, checkpoint_every=25, eval_every=4, warmup=3, out=str(whole))) == 0
    assert _losses(cut) == _losses(whole)
    assert [m["step"] for m in _lines(cut)] == [m["step"] for m in _lines(whole)]
    run = _run_json(cut)
    assert run["status"] == "finished" and run["resumed"] == [{"step": stopped_at, "date": run["resumed"][0]["date"],
                                                                "changed": {}}]


def _signal_at(monkeypatch, at_step, signum=signal.SIGINT, times=1):
    original = trainer_module.Trainer._forward_backward

    def signalled(self, step):
        if step == at_step:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return original(self, step)

    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward", signalled)
    return original


@pytest.mark.parametrize("offload", [{}, dict(offload="0-1", seq_len=131, micro_batch=4)])  # tensors past 64 KiB
def test_sigint_finishes_the_step_then_stops_and_checkpoint_every_0_writes_none(tmp_path, monkeypatch, offload):
    """Ctrl-C finishes the step, checkpoints it and stops; resumed, the losses are the uninterrupted run's (also with
    layers offloaded to host memory, whose pool the stop and the resume start afresh)."""
    common = dict(**{**TINY, **offload}, steps=12, eval_every=5)
    handler = signal.getsignal(signal.SIGINT)
    original = _signal_at(monkeypatch, 2)  # Ctrl-C while step 3 runs: it is finished, then the run stops
    assert train(TrainConfig(**common, checkpoint_every=5, out=str(tmp_path / "cut"))) == 130
    assert find_checkpoint(tmp_path / "cut")[1]["step"] == 3
    assert len(_losses(tmp_path / "cut")[0]) == 3 and _run_json(tmp_path / "cut")["step"] == 3
    assert train(TrainConfig(**common, checkpoint_every=0, out=str(tmp_path / "none"))) == 130
    assert not (tmp_path / "none" / "checkpoints").exists()
    run = _run_json(tmp_path / "none")
    assert run["status"] == "stopped" and "no checkpoint written" in run["message"] and run["step"] == 3
    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward", original)
    assert train(TrainConfig(**common, checkpoint_every=5, out=str(tmp_path / "cut"), resume=True)) == 0
    assert train(TrainConfig(**common, checkpoint_every=5, out=str(tmp_path / "whole"))) == 0
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    assert signal.getsignal(signal.SIGINT) is handler  # the handlers are put back
    if offload:
        assert _run_json(tmp_path / "cut")["offload"]["offloaded_bytes"] > 0


def test_a_second_signal_stops_at_once(tmp_path, monkeypatch):
    _signal_at(monkeypatch, 4, signal.SIGTERM, times=2)
    out = tmp_path / "run"
    assert train(TrainConfig(**TINY, steps=12, checkpoint_every=2, out=str(out))) == 130
    run = _run_json(out)
    assert run["status"] == "stopped" and "interrupted at step 4" in run["message"]
    assert find_checkpoint(out)[1]["step"] == 4  # the step in progress dropped


def _stop_worker(rank, world, root):
    """Two ranks; rank 1 alone receives SIGTERM during step 3: both must stop after it, then resume exactly."""
    from agoq.train import trainer as trainer_module

    base = dict(**TINY, steps=8, eval_every=3, checkpoint_every=5, parallel="ddp")
    codes = {"whole": train(TrainConfig(**base, out=os.path.join(root, "whole")))}
    original = trainer_module.Trainer._forward_backward

    def signalled(self, step):
        if step == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, step)

    trainer_module.Trainer._forward_backward = signalled
    try:
        codes["cut"] = train(TrainConfig(**base, out=os.path.join(root, "cut")))
    finally:
        trainer_module.Trainer._forward_backward = original
    codes["resumed"] = train(TrainConfig(**base, out=os.path.join(root, "cut"), resume=True))
    return codes


def test_every_rank_stops_at_the_same_step(tmp_path):
    from tests.multiprocess import run_workers

    codes = run_workers(_stop_worker, 2, str(tmp_path))
    assert codes == [{"whole": 0, "cut": 130, "resumed": 0}] * 2
    run = _run_json(tmp_path / "cut")
    assert run["resumed"][0]["step"] == 3 and run["status"] == "finished"
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")


# ------------------------------------------------------------------------------------------ one writer


def test_a_second_process_on_the_same_run_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(_cli("--steps", "100000", "--checkpoint-every", "50", "--out", str(out)), env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for_steps(first, out, 2)
        for extra in ([], ["--resume"]):
            second = subprocess.run(_cli("--steps", "100000", "--out", str(out), *extra), env=ENV,
                                    capture_output=True, text=True, timeout=120)
            assert second.returncode == 2, second.stderr
            assert str(out) in second.stderr and f"pid {first.pid}" in second.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 130
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        first.stderr.close()
    steps = [m["step"] for m in _lines(out) if "loss" in m]
    assert steps == list(range(1, len(steps) + 1))  # one writer: nothing interleaved
    assert _run_json(out)["status"] == "stopped"
    lock = RunLock(out)  # the lock went with the process
    lock.acquire()
    lock.release()


def test_the_lock_refuses_in_process_and_is_released_after_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    holder = RunLock(out)
    holder.acquire()
    try:
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):
            train(TrainConfig(**TINY, steps=2, out=str(out)))
        assert main(["train", "llama-tiny", "--seq-len", "32", "--steps", "2", "--quiet", "--out", str(out)]) == 2
        assert "in use by another agoq train" in capsys.readouterr().err
    finally:
        holder.release()
    assert not (out / "metrics.jsonl").exists()
    assert train(TrainConfig(**TINY, steps=2, out=str(out))) == 0
    again = RunLock(out)
    again.acquire()  # the finished run let go
    again.release()


# ------------------------------------------------------------------------------------------ settings on resume


def _cmd(out, *args):
    return ["train", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-batches", "2", "--quiet",
            "--checkpoint-every", "2", "--out", str(out), *args]


def test_resume_refuses_changed_settings_unless_overridden(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_cmd(out, "--steps", "20")) == 0
    capsys.readouterr()
    # changed without --override: refused, every change listed
    assert main(_cmd(out, "--steps", "40", "--lr", "5e-4", "--clip", "0.5", "--resume")) == 2
    err = capsys.readouterr().err
    assert "steps 20 -> 40" in err and "lr 0.001 -> 0.0005" in err and "clip 1.0 -> 0.5" in err
    assert "warmup 2 -> 4" in err and "eval_every 2 -> 4" in err and "explicitly" in err
    assert "--override steps,lr,warmup,clip,eval_every" in err
    # naming only some: still refused, for the others
    assert main(_cmd(out, "--steps", "40", "--lr", "5e-4", "--resume", "--override", "steps")) == 2
    err = capsys.readouterr().err
    assert "lr 0.001 -> 0.0005" in err and "steps 20" not in err
    # unknown names, settings the checkpoint fixes, --override without --resume
    assert main(_cmd(out, "--steps", "20", "--resume", "--override", "learning_rate")) == 2
    assert "not a setting a resumed run may change" in capsys.readouterr().err
    assert main(_cmd(out, "--steps", "20", "--resume", "--override", "micro-batch")) == 2
    assert "cannot change on resume" in capsys.readouterr().err
    assert main(_cmd(tmp_path / "other", "--steps", "20", "--override", "lr")) == 2
    assert "needs --resume" in capsys.readouterr().err
    run = _run_json(out)
    assert run["settings"]["steps"] == 20 and run["status"] == "finished"  # nothing refused touched run.json
    # named: accepted, recorded, the original settings kept
    assert main(_cmd(out, "--steps", "40", "--warmup", "2", "--lr", "5e-4", "--resume",
                     "--override", "steps,--lr,eval-every")) == 0
    assert "lr 0.001 -> 0.0005" in capsys.readouterr().err
    run = _run_json(out)
    assert run["status"] == "finished" and run["step"] == 40
    assert run["settings"]["lr"] == 5e-4 and run["settings"]["steps"] == 40 and run["settings"]["min_lr"] == 5e-5
    assert run["resumed"][-1]["step"] == 20
    assert run["resumed"][-1]["changed"] == {"steps": [20, 40], "lr": [0.001, 0.0005], "eval_every": [2, 4]}
    assert run["original_settings"]["lr"] == 0.001 and run["original_settings"]["steps"] == 20
    # resuming again with the new settings needs no --override, and keeps the first settings
    assert main(_cmd(out, "--steps", "40", "--warmup", "2", "--lr", "5e-4", "--resume")) == 0
    run = _run_json(out)
    assert run["resumed"][-1]["changed"] == {} and run["original_settings"]["lr"] == 0.001
    assert len(run["resumed"]) == 2


def test_the_data_cannot_change_on_resume_and_is_named_by_its_files(tmp_path, capsys):
    """Another data file is refused naming both files (not only their hashes); --override neither offers nor takes
    the data; the same content under another name resumes, and says so."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7))) for _ in range(50)]
    first, other, moved = tmp_path / "first.txt", tmp_path / "other.txt", tmp_path / "moved.txt"
    first.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    other.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    moved.write_bytes(first.read_bytes())
    out = tmp_path / "run"
    assert main(_cmd(out, "--steps", "2", "--data", str(first))) == 0
    capsys.readouterr()
    assert main(_cmd(out, "--steps", "2", "--data", str(other), "--resume")) == 2
    err = capsys.readouterr().err
    assert f"data {first} -> {other}, another content (sha256 " in err and "data_sha256" not in err, err
    assert main(_cmd(out, "--steps", "2", "--data", str(other), "--resume", "--override", "data")) == 2
    assert "--override data: the checkpoint's state depends on it" in capsys.readouterr().err
    assert main(_cmd(out, "--steps", "2", "--resume", "--override", "no_such_setting")) == 2
    listed = capsys.readouterr().err.split("those are ")[1].strip().split(", ")
    assert "steps" in listed and "lr" in listed
    assert not {"data", "data_sha256", "tokenizer", "seed", "pipeline_stages", "layer_stage"} & set(listed), listed
    assert main(_cmd(out, "--steps", "3", "--data", str(moved), "--resume", "--override", "steps")) == 0
    assert f"the data is read from {moved} now (the run began on {first}; the same content)" in \
        capsys.readouterr().err
    assert _run_json(out)["step"] == 3


# ------------------------------------------------------------------------------------------ heartbeat


def test_heartbeat_is_refreshed_by_a_thread_while_the_run_lives(tmp_path, monkeypatch):
    record = RunRecord(tmp_path / "run")
    monkeypatch.setattr(RunRecord, "heartbeat_seconds", 0.02)
    record.start({"settings": {}}, None)
    assert _run_json(tmp_path / "run")["heartbeat"]
    record.start_heartbeat()
    try:
        (tmp_path / "run" / "run.json").unlink()
        deadline = time.time() + 10
        while not (tmp_path / "run" / "run.json").exists() and time.time() < deadline:
            time.sleep(0.01)
        assert _run_json(tmp_path / "run")["status"] == "running"  # rewritten by the heartbeat alone
    finally:
        record.stop_heartbeat()
    assert not any(t.name == "agoq-run-heartbeat" for t in threading.enumerate())


def test_training_writes_the_heartbeat_and_stops_its_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(RunRecord, "heartbeat_seconds", 0.01)
    beats = []
    original = RunRecord.beat
    monkeypatch.setattr(RunRecord, "beat", lambda self: (beats.append(1), original(self)))
    slow = trainer_module.Trainer._forward_backward
    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward",
                        lambda self, step: (time.sleep(0.1), slow(self, step))[1])  # a step longer than a beat
    out = tmp_path / "run"
    assert train(TrainConfig(**TINY, steps=3, out=str(out))) == 0
    run = _run_json(out)
    assert run["status"] == "finished" and run["heartbeat"] >= run["started"]
    assert beats  # beats came while steps ran
    assert not any(t.name == "agoq-run-heartbeat" for t in threading.enumerate())
