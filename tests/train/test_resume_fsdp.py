"""FSDP2 runs (fsdp, fsdp with the int8 weight gather, hsdp exact and with its 4-bit all-reduce across nodes)
stopped by SIGTERM on one rank of 2, checkpointed by torch.distributed.checkpoint, and resumed by 3 and by 4 gloo
processes with the same tokens per step: each resumed run's losses follow the uninterrupted 2-process run's."""

import json
import os
import shutil
import signal
from pathlib import Path

from agoq.train.checkpoint import find_checkpoint
from agoq.train.trainer import TrainConfig, train
from tests.multiprocess import run_workers

TINY = dict(model="llama-tiny", seq_len=32, micro_batch=2, eval_batches=2, quiet=True)
# no periodic checkpoint before the end: the one at step 3 is SIGTERM's
BASE = dict(**TINY, steps=6, eval_every=3, checkpoint_every=100, warmup=2)
TOKENS = 12  # micro-batches of 2 sequences per step over all ranks: grad_accum = TOKENS / world (2, 3 and 4 ranks)
STOP_AFTER = 3
# exact communication resumed by another number of ranks: the mean gradient summed in another order (float32
# rounding, ~1e-7 relative), carried by Adam's sign-like first steps (tests/train/test_checkpoint.py's tolerance)
EXACT_LOSS_RTOL = 1e-3
# quantized communication: the int8 weight gather quantizes blocks of each rank's padded shard, TLq's 4-bit
# all-reduce draws its rounding per rank, so another world rounds other values (test_train_distributed's tolerance
# for quantized against exact runs)
QUANTIZED_LOSS_RTOL = 0.01

VARIANTS = {  # name: (settings at 2 ranks, at 3, at 4, loss tolerance)
    "fsdp": (dict(parallel="fsdp"), {}, {}, EXACT_LOSS_RTOL),
    "fsdp_int8_gather": (dict(parallel="fsdp", weight_gather="int8"), {}, {}, QUANTIZED_LOSS_RTOL),
    # 2 nodes of 1 rank -> 3 nodes of 1 (replicas only) -> 2 nodes of 2 (the node size changes: --override)
    "hsdp": (dict(parallel="hsdp", node_size=1), {}, dict(node_size=2, override="node_size"), EXACT_LOSS_RTOL),
    "hsdp_sdp4bit": (dict(parallel="hsdp", node_size=1, gradients="sdp4bit"), {},
                     dict(node_size=2, override="node_size"), QUANTIZED_LOSS_RTOL),
}


def _losses(run_dir):
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x], [x["val_loss"] for x in lines if "val_loss" in x]


def _worker(rank, world, root, stage):
    """stage "first" (2 ranks): each variant whole, and cut by SIGTERM on rank 1 during step 3; "resume" (3 or 4
    ranks): each variant's copy for this world resumed. Returns {run: exit code}."""
    from agoq.train import trainer as trainer_module

    codes = {}
    for name, (settings, at3, at4, _) in VARIANTS.items():
        if stage == "resume":
            extra = at3 if world == 3 else at4
            cfg = TrainConfig(**BASE, **{**settings, **extra}, grad_accum=TOKENS // world, resume=True,
                              out=os.path.join(root, f"{name}_{world}"))
            codes[name] = train(cfg)
            continue
        kwargs = dict(**BASE, **settings, grad_accum=TOKENS // world)
        codes[f"{name}_whole"] = train(TrainConfig(**kwargs, out=os.path.join(root, f"{name}_whole")))
        original = trainer_module.Trainer._forward_backward

        def signalled(self, step):
            if step == STOP_AFTER - 1 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(self, step)

        trainer_module.Trainer._forward_backward = signalled
        try:
            codes[f"{name}_cut"] = train(TrainConfig(**kwargs, out=os.path.join(root, f"{name}_cut")))
        finally:
            trainer_module.Trainer._forward_backward = original
    return codes


def test_fsdp_and_hsdp_stopped_at_two_ranks_resume_at_three_and_four(tmp_path):
    root = str(tmp_path)
    first = run_workers(_worker, 2, root, "first")
    assert first == [{f"{n}_{kind}": code for n in VARIANTS for kind, code in (("whole", 0), ("cut", 130))}] * 2
    for name in VARIANTS:
        folder, info = find_checkpoint(tmp_path / f"{name}_cut")
        assert info["step"] == STOP_AFTER and info["world"] == 2, name
        assert len(list(folder.glob("*.distcp"))) == 2  # each rank wrote its part
        for world in (3, 4):
            shutil.copytree(tmp_path / f"{name}_cut", tmp_path / f"{name}_{world}")
    for world in (3, 4):
        codes = run_workers(_worker, world, root, "resume")
        assert codes == [{name: 0 for name in VARIANTS}] * world, (world, codes)
    for name, (_, _, _, rtol) in VARIANTS.items():
        want = _losses(tmp_path / f"{name}_whole")
        assert _losses(tmp_path / f"{name}_cut")[0] == want[0][:STOP_AFTER]  # stopped after step 3, as it ran
        for world in (3, 4):
            got = _losses(tmp_path / f"{name}_{world}")
            assert got[0][:STOP_AFTER] == want[0][:STOP_AFTER] and len(got[0]) == BASE["steps"], (name, world)
            for g, w in zip(got[0][STOP_AFTER:] + got[1], want[0][STOP_AFTER:] + want[1]):
                assert abs(g - w) <= rtol * abs(w), (name, world, got, want)
            run = json.loads((tmp_path / f"{name}_{world}" / "run.json").read_text())
            assert run["status"] == "finished" and run["resumed"][0]["step"] == STOP_AFTER, (name, world)
            assert run["world"]["size"] == world and run["settings"]["grad_accum"] == TOKENS // world
    # the hsdp run at 4 ranks ran 2 nodes of 2 after the stop, its settings' change recorded
    run = json.loads((tmp_path / "hsdp_4" / "run.json").read_text())
    assert run["settings"]["node_size"] == 2 and run["resumed"][0]["changed"] == {"node_size": [1, 2]}
