"""`agoq train`'s settings: the parts check themselves, the flat constructor covers every flag and nothing else."""

import argparse

import pytest

from agoq.commands import train as train_command
from agoq.train.config import JobConfig, ParallelConfig, TrainConfig


def test_every_command_line_flag_is_one_setting():
    parser = argparse.ArgumentParser()
    train_command.configure(parser)
    dests = {a.dest for a in parser._actions if a.dest not in ("help",)}
    assert set(JobConfig.flag_names()) == dests
    assert len(JobConfig.flag_names()) == len(set(JobConfig.flag_names()))  # no two parts share a name


def test_flat_settings_reach_their_parts():
    cfg = TrainConfig(seq_len=32, lr=3e-4, parallel="fsdp", node_size=2, out="x", steps=5, compile=True)
    assert (cfg.data.seq_len, cfg.optim.lr, cfg.parallelism.node_size, cfg.checkpoint.out, cfg.loop.steps) == (
        32, 3e-4, 2, "x", 5)
    assert cfg.model.compile and cfg.model.compile_mode == "default"
    with pytest.raises(TypeError, match="unknown training setting"):
        TrainConfig(seq_length=32)


@pytest.mark.parametrize("flags, message", [
    (dict(master="none"), "--master none"),
    (dict(optimizer="sgd"), "--optimizer must be one of"),
    (dict(lr=0.0), "--lr must be > 0"),
    (dict(steps=0), "--steps must be >= 1"),
    (dict(plan="p.json", policy="int8"), "give either --plan or --policy"),
    (dict(parallel="tensor"), "--parallel must be one of"),
    (dict(node_size=2), "--node-size is for --parallel fsdp"),
    (dict(parallel="sharded"), "own sharded path.*was retired"),
    (dict(parallel="ddp", pipeline_stages=2), "--pipeline-stages is for --parallel pipeline"),
    (dict(device="tpu"), "--device must be cpu or cuda"),
    (dict(dtype="int8"), "--dtype must be one of"),
])
def test_parts_refuse_bad_settings_with_the_command_line_message(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**flags)


def test_parallel_mode_follows_the_number_of_processes():
    assert ParallelConfig().mode_for(1) == "none" and ParallelConfig().mode_for(2) == "ddp"
    with pytest.raises(ValueError, match="needs several processes"):
        ParallelConfig(parallel="pipeline").mode_for(1)
    with pytest.raises(ValueError, match="--parallel none with 2 processes"):
        ParallelConfig(parallel="none").mode_for(2)
    with pytest.raises(ValueError, match="--pipeline-stages 3 but 2 processes"):
        ParallelConfig(parallel="pipeline", pipeline_stages=3).mode_for(2)


@pytest.mark.parametrize("field,value", [("eval_every", 0), ("eval_every", -3), ("eval_batches", 0)])
def test_a_loop_from_python_refuses_what_the_command_line_refuses(field, value):
    """`train(TrainConfig(...))` from Python gets the command line's refusal (the loop would divide by
    eval_every, or evaluate on no batch), naming the flag and the value."""
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be >= 1.*got {value}"):
        TrainConfig(model="llama-tiny", device="cpu", **{field: value})
