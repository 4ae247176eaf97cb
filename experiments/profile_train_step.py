"""Where a training step's time goes: `agoq train`'s own step under torch.profiler, one configuration.

Takes `agoq train`'s arguments, builds the run as `agoq train` does (no run folder is written), runs a few
warm-up steps, then profiles `--steps` steps and prints (and writes to --out) the kernels by GPU time and
the host time per step, so a step slower than predicted can be read kernel by kernel.

    python experiments/profile_train_step.py experiments/train_llama_byte.json --data DATA \
        --policy agoq-paper --gradients quangrad8 --optimizer adamw8bit --micro-batch 4 --seq-len 1024
"""

from __future__ import annotations

import argparse
import gc
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


def _union(intervals: list) -> list:
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(a: list, b: list) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_timeline(trace: Path, steps: int) -> str:
    """Per step: each CUDA stream's busy time (kernels and copies), the copies by direction (bytes, time, GB/s),
    and the compute stream's idle time, with the part of it during which a device-to-host or host-to-device copy
    was in flight (what the compute stream may have waited for). Times in ms per step."""
    import json

    events = json.loads(trace.read_text()).get("traceEvents", [])
    busy: dict = {}
    copies: dict = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = e.get("args", {}).get("stream", e.get("tid"))
        a, b = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        busy.setdefault(stream, []).append((a, b))
        if e["cat"] == "gpu_memcpy":
            kind = e.get("name", "")
            direction = "DtoH" if "DtoH" in kind else "HtoD" if "HtoD" in kind else "DtoD"
            got = copies.setdefault((stream, direction), [0, 0.0, []])
            got[0] += int(e.get("args", {}).get("bytes", 0))
            got[1] += b - a
            got[2].append((a, b))
    if not busy:
        return "timeline: no device events in the trace"
    compute = max(busy, key=lambda s: sum(b - a for a, b in busy[s]))
    spans = {s: _union(v) for s, v in busy.items()}
    start = min(iv[0][0] for iv in spans.values())
    end = max(iv[-1][1] for iv in spans.values())
    idle = _union([(a, b) for (a, b) in zip([start] + [iv[1] for iv in spans[compute]],
                                            [iv[0] for iv in spans[compute]] + [end]) if b > a])
    lines = [f"timeline ({steps} steps, per step): compute stream {compute}; span {(end - start) / 1e3 / steps:.2f} ms, "
             f"compute busy {sum(b - a for a, b in spans[compute]) / 1e3 / steps:.2f} ms, "
             f"idle {sum(b - a for a, b in idle) / 1e3 / steps:.2f} ms"]
    for s in sorted(spans, key=str):
        lines.append(f"  stream {s}: busy {sum(b - a for a, b in spans[s]) / 1e3 / steps:.2f} ms")
    for direction in ("DtoH", "HtoD"):
        flight = _union([iv for (s, d), got in copies.items() if d == direction and s != compute for iv in got[2]])
        if flight:
            lines.append(f"  compute idle while a side-stream {direction} copy was in flight: "
                         f"{_overlap(idle, flight) / 1e3 / steps:.2f} ms")
    for (s, d), (nbytes, dur, _) in sorted(copies.items(), key=str):
        rate = nbytes / (dur * 1e-6) / 1e9 if dur > 0 else 0.0
        lines.append(f"  copies {d} on stream {s}: {nbytes / 1e9 / steps:.3f} GB, {dur / 1e3 / steps:.2f} ms "
                     f"({rate:.1f} GB/s)")
    return "\n".join(lines)


def collector_time():
    """A gc callback that adds up the time of Python's garbage collections, by generation."""
    seconds, count, started = [0.0, 0.0, 0.0], [0, 0, 0], [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            seconds[info["generation"]] += time.perf_counter() - started[0]
            count[info["generation"]] += 1

    callback.report = lambda steps: ", ".join(
        f"generation {g}: {count[g] / steps:.1f} collections, {seconds[g] / steps * 1e3:.2f} ms" for g in range(3))
    gc.callbacks.append(callback)
    return callback


def python_host_time(trainer, steps: int, rows: int) -> str:
    """`steps` more steps under cProfile: the `rows` functions with the most host time of their own, per step."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for step in range(steps):
        trainer.step(step)
    sync()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    total = sum(v[2] for v in stats.stats.values())  # tottime over every function
    return f"Python host time under cProfile: {total / steps * 1e3:.1f} ms per step\n" + out.getvalue()


def trainer_from_arguments(argv: list[str], prog: str) -> Trainer:
    """`agoq train`'s arguments (a plan included) as the Trainer `agoq train` builds, writing no run folder."""
    parser = argparse.ArgumentParser(prog=prog)
    train_command.configure(parser)
    args = parser.parse_args(argv)
    fields = set(JobConfig.flag_names())
    settings = {k: v for k, v in vars(args).items() if k in fields}
    cfg = TrainConfig(**{**settings, "out": tempfile.mkdtemp(), "quiet": True})
    return Trainer(prepare(cfg, join_world(cfg.model.device)))


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--report", default=None, help="also write the tables to this file")
    ap.add_argument("--timeline", action="store_true",
                    help="also read the trace stream by stream: each stream's busy time, the copies' bytes and time "
                         "each way, and how long the compute stream sat idle while a copy was in flight")
    ap.add_argument("--stacks", default=None, metavar="NAMES",
                    help="comma-separated operation names (e.g. cudaStreamSynchronize,aten::cat): also print the "
                         "Python call stacks they were called from, by host time")
    ap.add_argument("--python", type=int, default=0, metavar="N",
                    help="also time the profiled steps under cProfile and print the N Python functions with the "
                         "most host time of their own (where host-bound steps spend it)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="after the warm-up steps, collect once and freeze what is left (gc.freeze): later "
                         "collections no longer walk the compiled graphs' objects")
    ours, rest = ap.parse_known_args()
    trainer = trainer_from_arguments(rest, "profile_train_step")
    for step in range(ours.warmup_steps):
        trainer.step(step)
    sync()
    if ours.gc_freeze:
        gc.collect()
        gc.freeze()
    collections = collector_time()
    t0 = time.perf_counter()
    for step in range(ours.profile_steps):
        trainer.step(step)
    sync()
    plain = (time.perf_counter() - t0) / ours.profile_steps
    gc.callbacks.remove(collections)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=bool(ours.stacks)) as prof:
        for step in range(ours.profile_steps):
            trainer.step(step)
        sync()
    python_table = python_host_time(trainer, ours.profile_steps, ours.python) if ours.python else None
    events = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in events) / ours.profile_steps / 1e3
    text = [f"step (unprofiled): {plain * 1e3:.2f} ms; kernels' GPU time per step: {gpu_total:.2f} ms; "
            f"GPU idle per step: {plain * 1e3 - gpu_total:.2f} ms",
            f"garbage collection (unprofiled steps, per step): {collections.report(ours.profile_steps)}",
            events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70),
            events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)]
    if ours.stacks:
        wanted = set(ours.stacks.split(","))
        by_stack = [e for e in prof.key_averages(group_by_stack_n=12) if e.key in wanted]
        for e in sorted(by_stack, key=lambda e: -e.self_cpu_time_total)[:12]:
            text.append(f"{e.key}: {e.count} calls, {e.self_cpu_time_total / 1e3:.1f} ms host time, from:\n    "
                        + "\n    ".join(e.stack or ["(no Python stack)"]))
    if python_table:
        text.append(python_table)
    if ours.timeline:
        trace = Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(trace))
        text.append(stream_timeline(trace, ours.profile_steps))
    report = "\n".join(text)
    print(report)
    if ours.report:
        Path(ours.report).write_text(report)


if __name__ == "__main__":
    main()
