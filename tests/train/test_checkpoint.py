"""Checkpoints through torch.distributed.checkpoint: bitwise resume in one process, a save killed half-way,
format 1 and the retired sharded mode's checkpoints refused, and a gloo run saved by 2 processes resumed by 1
(FSDP2's resharding: tests/train/test_resume_fsdp.py)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from agoq.train import checkpoint as checkpoint_module
from agoq.train import trainer as trainer_module
from agoq.train.checkpoint import clean_partial, find_checkpoint, load_checkpoint, save_checkpoint
from agoq.train.trainer import TrainConfig, train
from tests.multiprocess import run_workers

TINY = dict(model="llama-tiny", seq_len=32, micro_batch=2, eval_batches=2, quiet=True)
# Loss of a run resumed by another number of processes against the uninterrupted one, relative, per step. Both
# read the same sequences per step; the gradient's mean is summed in another order (float32 rounding, ~1e-7
# relative), which Adam's sign-like first steps and the 8-bit moments' requantization (a value on a code
# boundary moves one float8 step) carry into the weights: the exact-mode tolerance of test_train_distributed.
EXACT_LOSS_RTOL = 1e-3


def _losses(run_dir):
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x], [x["val_loss"] for x in lines if "val_loss" in x]


def _flatten(tree, prefix=""):
    """{dotted key: value} of a nested state dict."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _saved(folder, tmp_path):
    """The logical state a checkpoint folder holds, {dotted key: tensor or value} (whole tensors, however saved)."""
    path = tmp_path / f"{folder.name}-{os.urandom(3).hex()}.pt"
    dcp_to_torch_save(str(folder), str(path))
    return _flatten(torch.load(path, weights_only=False))


class _Killed(BaseException):
    """Stands for a kill: nothing in the trainer catches it."""


def _kill_at(monkeypatch, at_step):
    original = trainer_module.Trainer._forward_backward

    def dying(self, step):
        if step == at_step:
            raise _Killed()
        return original(self, step)

    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward", dying)
    return original


# ------------------------------------------------------------------------------------------ one process

@pytest.mark.parametrize("variant", [
    dict(dtype="bf16", optimizer="adamw8bit"),  # fused 8-bit AdamW, float32 masters in its state
    dict(dtype="bf16", optimizer="adamw8bit", master="none"),  # no masters: stochastic rounding
    dict(dtype="bf16", optimizer="adamw8bit", gradients="quangrad8"),  # QuanGrad's 8-bit gradients read in place
    dict(dtype="bf16", optimizer="adamw"),  # torch's AdamW on float32 masters kept beside it
    # layers 0-1's saved tensors in host memory (tensors past offload's 64 KiB at 4 x 131 tokens)
    dict(dtype="bf16", optimizer="adamw8bit", offload="0-1", seq_len=131, micro_batch=4),
])
def test_resume_is_bitwise_the_uninterrupted_run(tmp_path, monkeypatch, variant):
    """Train 7 steps saving at 3 and 6, die in step 5, resume: the losses and the final checkpoint (weights,
    masters, 8-bit moment codes and scales, step counts) are the uninterrupted run's, byte for byte."""
    common = dict(**{**TINY, **variant}, steps=7, grad_accum=2, checkpoint_every=3, eval_every=3, warmup=2)
    assert train(TrainConfig(**common, out=str(tmp_path / "whole"))) == 0
    original = _kill_at(monkeypatch, 4)
    with pytest.raises(_Killed):
        train(TrainConfig(**common, out=str(tmp_path / "cut")))
    assert find_checkpoint(tmp_path / "cut")[1]["step"] == 3
    monkeypatch.setattr(trainer_module.Trainer, "_forward_backward", original)
    assert train(TrainConfig(**common, out=str(tmp_path / "cut"), resume=True)) == 0
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    if "offload" in variant:  # the resumed run offloaded too
        moved = json.loads((tmp_path / "cut" / "run.json").read_text())["offload"]
        assert moved["offloaded_bytes"] > 0 and set(moved["bytes_per_layer"]) == {"0", "1"}
    whole = _saved(find_checkpoint(tmp_path / "whole")[0], tmp_path)
    cut = _saved(find_checkpoint(tmp_path / "cut")[0], tmp_path)
    assert set(whole) == set(cut)
    tensors = [k for k, v in whole.items() if isinstance(v, torch.Tensor)]
    assert tensors
    for k in tensors:
        assert whole[k].dtype == cut[k].dtype and torch.equal(whole[k], cut[k]), k
    if variant["optimizer"] == "adamw8bit":  # the moments are saved as stored: 8-bit codes and their scales
        codes = [k for k in tensors if k.endswith("exp_avg_codes")]
        assert codes and all(whole[k].dtype == torch.uint8 for k in codes)
        assert not any(k.endswith(".exp_avg") and whole[k].numel() >= 4096 for k in tensors)
        assert any(k.endswith(".master") for k in tensors) == (variant.get("master") != "none")
    else:
        assert any(k.startswith("optimizer.masters.") for k in tensors)


def test_a_save_killed_half_way_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A kill while DCP writes step 4 leaves step 2 the latest and whole; the next start clears the leftovers and
    --resume continues from step 2. A folder renamed but not yet named by latest.json is a leftover too."""
    out = tmp_path / "run"
    common = dict(**TINY, steps=6, checkpoint_every=2, eval_every=3, warmup=2)
    real_save = checkpoint_module.dcp.save

    def dying_save(state_dict, *, storage_writer, **kwargs):
        if "00000004" in str(storage_writer.path):
            (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"cut short")
            raise _Killed()
        return real_save(state_dict, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", dying_save)
    with pytest.raises(_Killed):
        train(TrainConfig(**common, out=str(out)))
    monkeypatch.setattr(checkpoint_module.dcp, "save", real_save)
    root = out / "checkpoints"
    assert (root / ".step-00000004.tmp").is_dir()
    folder, info = find_checkpoint(out)
    assert folder.name == "step-00000002" and info["step"] == 2
    shutil.copytree(folder, root / "step-00000003")  # renamed, killed before latest.json was written
    assert find_checkpoint(out)[0].name == "step-00000002"
    clean_partial(out)
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step-00000002"]
    assert train(TrainConfig(**common, out=str(out), resume=True)) == 0
    assert train(TrainConfig(**common, out=str(tmp_path / "whole"))) == 0
    assert _losses(out) == _losses(tmp_path / "whole")
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step-00000006"]


def test_format_1_and_foreign_checkpoints_are_refused_with_what_to_do(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps({"schema": "agoq.checkpoint/1", "step": 4, "world": 1}))
    with pytest.raises(ValueError, match="format agoq.checkpoint/1.*reads agoq.checkpoint/2.*agoq that wrote it"):
        find_checkpoint(out)
    # a checkpoint of another optimizer: refused before anything is loaded, naming the setting
    run = tmp_path / "other"
    assert train(TrainConfig(**TINY, steps=2, checkpoint_every=2, dtype="bf16", optimizer="adamw",
                             out=str(run))) == 0
    with pytest.raises(ValueError, match="optimizer 'adamw' -> 'adamw8bit'"):
        train(TrainConfig(**TINY, steps=4, checkpoint_every=2, dtype="bf16", optimizer="adamw8bit", out=str(run),
                          resume=True))
    # a state dict that does not fit the checkpoint: DCP's complaint, and what to do
    folder, _ = find_checkpoint(run)
    with pytest.raises(ValueError, match="does not fit this run's model and optimizer.*settings that wrote it"):
        load_checkpoint(folder, {"model": {"no.such.weight": torch.zeros(3)}})


def test_a_checkpoint_of_the_retired_sharded_mode_is_refused_with_what_to_run(tmp_path, seed):
    """A checkpoint written by --parallel sharded (agoq.json's parallel "sharded") does not resume: the message
    says the own sharded path was retired and what to run instead; the checkpoint is left as it was."""
    out = tmp_path / "run"
    weights = torch.randn(7, generator=torch.Generator().manual_seed(seed))
    save_checkpoint(out, 3, {"x": weights}, {"parallel": "sharded", "resume": {}}, rank=0, world=2,
                    barrier=lambda: None)
    before = sorted((out / "checkpoints").rglob("*"))
    with pytest.raises(ValueError, match=r"--parallel sharded and does not resume.*retired.*--parallel fsdp "
                                         r"--gradients sdp4bit --weight-gather int4 --node-size 1"):
        train(TrainConfig(**TINY, steps=4, out=str(out), resume=True))
    assert sorted((out / "checkpoints").rglob("*")) == before
    folder, _ = find_checkpoint(out)
    state = {"x": torch.zeros(7)}
    load_checkpoint(folder, state)
    assert torch.equal(state["x"], weights)  # the checkpoint itself is intact


# ------------------------------------------------------------------------------------------ gloo: 2 -> 1, 2 -> 4

BASE = dict(**TINY, steps=6, eval_every=3, checkpoint_every=3, warmup=2)
TOKENS = 4  # micro-batches of 2 sequences per step over all ranks: grad_accum = TOKENS / world


def _state_after_load(captured):
    """Wrap Trainer.try_resume so that the state this rank holds right after loading is kept in `captured`."""
    original = trainer_module.Trainer.try_resume

    def recording(self):
        step = original(self)
        if step is not None:
            flat = _flatten(self._state(ranks_saved=0))
            captured.update({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()})
        return step

    trainer_module.Trainer.try_resume = recording
    return original


def _gloo_worker(rank, world, root, runs):
    """Each run: (name, settings, kill_at, resume). Returns {name: (exit code, state right after loading)}."""
    out = {}
    for name, kwargs, kill_at, resume in runs:
        cfg = TrainConfig(**BASE, **kwargs, grad_accum=TOKENS // world, out=os.path.join(root, name), resume=resume)
        captured: dict = {}
        original_fb = trainer_module.Trainer._forward_backward
        original_resume = _state_after_load(captured)

        def dying(self, step):
            if step == kill_at:
                raise _Killed()
            return original_fb(self, step)

        trainer_module.Trainer._forward_backward = dying
        try:
            code = train(cfg)
        except _Killed:
            code = "killed"
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
        finally:
            trainer_module.Trainer._forward_backward = original_fb
            trainer_module.Trainer.try_resume = original_resume
        out[name] = (code, captured)
    return out


def _equal_state(saved, loaded_by_rank, prefix=""):
    """Every saved value equals what the loading ranks hold (whole tensors on every rank)."""
    for k, v in loaded_by_rank[0].items():
        if k.startswith("rng."):
            continue
        if isinstance(v, torch.Tensor):
            for state in loaded_by_rank:
                assert state[k].dtype == saved[k].dtype and torch.equal(state[k], saved[k]), k
        else:
            assert all(state[k] == saved[k] for state in loaded_by_rank), (k, v, saved[k])


def test_saved_by_two_processes_resumed_by_one(tmp_path):
    """DDP with the fused 8-bit AdamW (replicated 8-bit state) saved at step 3 by 2 gloo processes and resumed by
    1 process with the same tokens per step: the state right after loading is the saved logical state bit for
    bit, and the losses of steps 4-6 follow the uninterrupted 2-process run's."""
    ddp = dict(parallel="ddp", dtype="bf16", optimizer="adamw8bit")
    root = str(tmp_path)
    run_workers(_gloo_worker, 2, root, [("ddp_whole", ddp, None, False), ("ddp_cut", ddp, 3, False)])
    assert find_checkpoint(tmp_path / "ddp_cut")[1]["world"] == 2
    assert len(list(find_checkpoint(tmp_path / "ddp_cut")[0].glob("*.distcp"))) == 2  # each rank wrote its part
    saved_ddp = _saved(find_checkpoint(tmp_path / "ddp_cut")[0], tmp_path)

    [one] = run_workers(_gloo_worker, 1, root, [("ddp_cut", dict(ddp, parallel="none"), None, True)])
    assert one["ddp_cut"][0] == 0
    _equal_state(saved_ddp, [one["ddp_cut"][1]])
    got, want = _losses(tmp_path / "ddp_cut"), _losses(tmp_path / "ddp_whole")
    assert got[0][:3] == want[0][:3]  # before the resume: the same 2-process run
    for g, w in zip(got[0][3:] + got[1], want[0][3:] + want[1]):
        assert abs(g - w) <= EXACT_LOSS_RTOL * abs(w), (got, want)
    assert len(got[0]) == 6
    run = json.loads((tmp_path / "ddp_cut" / "run.json").read_text())
    assert run["world"]["size"] == 1 and run["settings"]["grad_accum"] == 4 and run["resumed"][0]["step"] == 3
