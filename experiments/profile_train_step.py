"""Where a training step's time goes: `agoq train`'s own step under torch.profiler, one configuration.

Takes `agoq train`'s arguments, builds the run as `agoq train` does (no run folder is written), runs a few
warm-up steps, then profiles `--steps` steps and prints (and writes to --out) the kernels by GPU time and
the host time per step, so a step slower than predicted can be read kernel by kernel.

    python experiments/profile_train_step.py experiments/train_llama_byte.json --data DATA \
        --policy agoq-paper --gradients quangrad8 --optimizer adamw8bit --micro-batch 4 --seq-len 1024
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoq.commands import train as train_command  # noqa: E402
from agoq.train.config import JobConfig, TrainConfig  # noqa: E402
from agoq.train.parallel import join_world  # noqa: E402
from agoq.train.trainer import Trainer, prepare  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--report", default=None, help="also write the tables to this file")
    ap.add_argument("--stacks", default=None, metavar="NAMES",
                    help="comma-separated operation names (e.g. cudaStreamSynchronize,aten::cat): also print the "
                         "Python call stacks they were called from, by host time")
    ours, rest = ap.parse_known_args()
    parser = argparse.ArgumentParser(prog="profile_train_step")
    train_command.configure(parser)
    args = parser.parse_args(rest)
    fields = set(JobConfig.flag_names())
    settings = {k: v for k, v in vars(args).items() if k in fields}
    cfg = TrainConfig(**{**settings, "out": tempfile.mkdtemp(), "quiet": True})
    world = join_world(cfg.model.device)
    trainer = Trainer(prepare(cfg, world))
    for step in range(ours.warmup_steps):
        trainer.step(step)
    sync()
    t0 = time.perf_counter()
    for step in range(ours.profile_steps):
        trainer.step(step)
    sync()
    plain = (time.perf_counter() - t0) / ours.profile_steps
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=bool(ours.stacks)) as prof:
        for step in range(ours.profile_steps):
            trainer.step(step)
        sync()
    events = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in events) / ours.profile_steps / 1e3
    text = [f"step (unprofiled): {plain * 1e3:.2f} ms; kernels' GPU time per step: {gpu_total:.2f} ms; "
            f"GPU idle per step: {plain * 1e3 - gpu_total:.2f} ms",
            events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70),
            events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)]
    if ours.stacks:
        wanted = set(ours.stacks.split(","))
        by_stack = [e for e in prof.key_averages(group_by_stack_n=12) if e.key in wanted]
        for e in sorted(by_stack, key=lambda e: -e.self_cpu_time_total)[:12]:
            text.append(f"{e.key}: {e.count} calls, {e.self_cpu_time_total / 1e3:.1f} ms host time, from:\n    "
                        + "\n    ".join(e.stack or ["(no Python stack)"]))
    report = "\n".join(text)
    print(report)
    if ours.report:
        Path(ours.report).write_text(report)


if __name__ == "__main__":
    main()
