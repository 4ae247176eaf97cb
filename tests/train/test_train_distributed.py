"""`agoq train` over gloo: DDP (bf16, QuanGrad), sharded (exact, SDP4Bit), 1F1B pipeline, against one process."""

import json
import os
from pathlib import Path

from agoq.train.trainer import TrainConfig, train
from tests.multiprocess import run_workers

BASE = dict(model="llama-tiny", seq_len=32, micro_batch=2, steps=6, eval_every=3, eval_batches=2,
            checkpoint_every=3, quiet=True)
# 8-bit / 4-bit communication against exact training, relative loss difference per step (measured < 0.1 %)
QUANTIZED_LOSS_RTOL = 0.01
# exact modes: the same arithmetic summed in another order; Adam's first steps (update ~ sign of the
# gradient) turn rounding-level gradient differences into ~1e-4 relative loss differences
EXACT_LOSS_RTOL = 1e-3


def _losses(run_dir):
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x], [x["val_loss"] for x in lines if "val_loss" in x]


class _Killed(BaseException):
    pass


def _worker(rank, world, root, runs):
    from agoq.train import trainer as trainer_module

    out = {}
    for name, kwargs in runs:
        kill_at = kwargs.pop("kill_at", None)
        cfg = TrainConfig(**BASE, **kwargs, out=os.path.join(root, name))
        if kill_at is not None:
            original = trainer_module.Trainer._forward_backward

            def dying(self, step):
                if step == kill_at:
                    raise _Killed()
                return original(self, step)

            trainer_module.Trainer._forward_backward = dying
            try:
                train(cfg)
            except _Killed:
                pass
            finally:
                trainer_module.Trainer._forward_backward = original
            cfg = TrainConfig(**BASE, **kwargs, out=os.path.join(root, name), resume=True)
        out[name] = train(cfg)
    return out


def _single(tmp_path, name, **kwargs):
    out = tmp_path / name
    assert train(TrainConfig(**BASE, **kwargs, out=str(out))) == 0
    return _losses(out)


def _close(got, ref, rtol):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert abs(g - r) <= rtol * abs(r), (got, ref)


def test_two_processes_ddp_sharded_pipeline(tmp_path):
    runs = [
        ("ddp_bf16", dict(parallel="ddp")),
        ("ddp_quangrad8", dict(parallel="ddp", gradients="quangrad8", optimizer="adamw8bit")),
        ("sharded_exact", dict(parallel="sharded")),
        ("sharded_sdp4bit", dict(parallel="sharded", gradients="sdp4bit", kill_at=4)),  # killed, then resumed
        ("sharded_sdp4bit_int4", dict(parallel="sharded", gradients="sdp4bit", node_size=1)),  # 2 "nodes": int4
        ("pipeline", dict(parallel="pipeline", grad_accum=2)),
        ("pipeline_stage_bits", dict(parallel="pipeline", grad_accum=3, policy="stage-aware", gradients="quangrad8")),
    ]
    codes = run_workers(_worker, 2, str(tmp_path), runs)
    assert all(c == 0 for rank in codes for c in rank.values()), codes
    # two ranks x 2 sequences read the same sequences as one process accumulating 2 micro-batches of 2
    ref, ref_val = _single(tmp_path, "single", grad_accum=2)
    ref8, ref8_val = _single(tmp_path, "single_8bit", grad_accum=2, optimizer="adamw8bit")
    for name, rtol, want, want_val in [("ddp_bf16", EXACT_LOSS_RTOL, ref, ref_val),
                                       ("sharded_exact", EXACT_LOSS_RTOL, ref, ref_val),
                                       ("pipeline", EXACT_LOSS_RTOL, ref, ref_val),
                                       ("ddp_quangrad8", QUANTIZED_LOSS_RTOL, ref8, ref8_val),
                                       ("sharded_sdp4bit", QUANTIZED_LOSS_RTOL, ref, ref_val),
                                       ("sharded_sdp4bit_int4", QUANTIZED_LOSS_RTOL, ref, ref_val)]:
        got, got_val = _losses(tmp_path / name)
        _close(got, want, rtol)
        _close(got_val, want_val, rtol)
    # the quantized runs really differ from exact ones
    assert _losses(tmp_path / "ddp_quangrad8")[0][1:] != ref8[1:]
    assert _losses(tmp_path / "sharded_sdp4bit")[0][1:] != ref[1:]
    run = json.loads((tmp_path / "sharded_sdp4bit" / "run.json").read_text())
    assert run["status"] == "finished" and run["resumed"][0]["step"] == 3 and run["world"]["size"] == 2
    staged = json.loads((tmp_path / "pipeline_stage_bits" / "run.json").read_text())
    assert staged["settings"]["policy"] == "stage-aware-4-8"  # 1F1B, 2 stages: 2 and 1 micro-batches in flight
    assert staged["settings"]["layer_stage"] == [0, 0, 1]
    ref3, _ = _single(tmp_path, "single3", grad_accum=3)  # 4 to 8 bits and 8-bit gradients against exact
    _close(_losses(tmp_path / "pipeline_stage_bits")[0], ref3, 0.02)
    metrics = [json.loads(x) for x in (tmp_path / "pipeline" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(m["peak_bytes"]) == 2 for m in metrics if "loss" in m)


def test_three_processes_quangrad_and_sdp4bit(tmp_path):
    runs = [("ddp_quangrad8", dict(parallel="ddp", gradients="quangrad8")),
            ("sharded_sdp4bit", dict(parallel="sharded", gradients="sdp4bit"))]
    run_workers(_worker, 3, str(tmp_path), runs)
    ref, ref_val = _single(tmp_path, "single", grad_accum=3)
    for name in ("ddp_quangrad8", "sharded_sdp4bit"):
        got, got_val = _losses(tmp_path / name)
        _close(got, ref, QUANTIZED_LOSS_RTOL)
        _close(got_val, ref_val, QUANTIZED_LOSS_RTOL)


def test_two_processes_fsdp(tmp_path):
    """FSDP2: exact (killed, then resumed from its DTensor checkpoint), with TLq-HS gradients, with the fused
    8-bit AdamW on the local shards; the grad norm is the averaged gradient's, as in one process."""
    runs = [("fsdp_exact", dict(parallel="fsdp", kill_at=4)),
            ("fsdp_sdp4bit", dict(parallel="fsdp", gradients="sdp4bit")),
            ("fsdp_8bit", dict(parallel="fsdp", optimizer="adamw8bit"))]
    codes = run_workers(_worker, 2, str(tmp_path), runs)
    assert all(c == 0 for rank in codes for c in rank.values()), codes
    ref, ref_val = _single(tmp_path, "single", grad_accum=2)
    ref8, ref8_val = _single(tmp_path, "single_8bit", grad_accum=2, optimizer="adamw8bit")
    for name, rtol, want, want_val in [("fsdp_exact", EXACT_LOSS_RTOL, ref, ref_val),
                                       ("fsdp_sdp4bit", QUANTIZED_LOSS_RTOL, ref, ref_val),
                                       # moments block-quantized per shard rather than per tensor
                                       ("fsdp_8bit", QUANTIZED_LOSS_RTOL, ref8, ref8_val)]:
        got, got_val = _losses(tmp_path / name)
        _close(got, want, rtol)
        _close(got_val, want_val, rtol)
    assert _losses(tmp_path / "fsdp_sdp4bit")[0][1:] != ref[1:]
    norms = [[json.loads(x)["grad_norm"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
              if "grad_norm" in x] for name in ("single", "fsdp_exact")]
    _close(norms[1], norms[0], EXACT_LOSS_RTOL)
    run = json.loads((tmp_path / "fsdp_exact" / "run.json").read_text())
    assert run["status"] == "finished" and run["resumed"][0]["step"] == 3 and run["settings"]["parallel"] == "fsdp"
