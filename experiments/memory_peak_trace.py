"""Where in a training step its GPU memory peaks: the caching allocator's own record of one step, replayed.

Takes `agoq train`'s arguments (a plan included), builds the run as `agoq train` does (no run folder is written),
runs `--warmup-steps` steps, then records one step with torch.cuda.memory._record_memory_history (Python stacks)
and replays its allocations and frees in order: the bytes allocated after each event, their largest value (the
step's peak, which the trainer's step figure also reports), and what was allocated just before it, each
allocation named by the innermost agoq frame that made it (a layer's forward or its rerun, an offloaded layer's
fetch, the optimizer, ...). Prints the events where the allocated bytes pass each of a few levels on the way to
the peak, and writes experiments/results/NAME.json.

    python experiments/memory_peak_trace.py probe --plan plan.json --data DATA --name memory_peak_trace_probe
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.profile_train_step import trainer_from_arguments  # noqa: E402
from experiments.record import write_result  # noqa: E402


def where(frames: list[dict]) -> str:
    """The innermost frames in agoq's own code (not torch's), as file:line function."""
    ours = [f for f in frames or [] if "agoq/" in f.get("filename", "")]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in ours[:3]) or "(torch)"


def replay(trace: list[dict], start: int) -> tuple[list[dict], int]:
    """The allocated bytes after each alloc / free request of `trace` (one device's), starting from `start` bytes
    (torch.cuda.memory_allocated counts a block freed when its free is requested)."""
    now, out = start, []
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            now += e["size"]
        elif e["action"] == "free_requested":  # the allocator's allocated bytes drop here (a block a side stream
            now -= e["size"]                   # still uses completes its free later, when that stream is done)
        else:
            continue
        out.append({"index": i, "action": e["action"], "size": int(e["size"]), "allocated": int(now),
                    "where": where(e.get("frames"))})
    return out, now


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=25, help="events kept before the peak")
    ap.add_argument("--name", default=None, help="write experiments/results/NAME.json")
    ours, rest = ap.parse_known_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_peak_trace reads the CUDA caching allocator: run it on a GPU")
    trainer = trainer_from_arguments(rest, "memory_peak_trace")
    for step in range(ours.warmup_steps):
        trainer.step(step)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    result = trainer.step(ours.warmup_steps)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_reported = result.peak_bytes[0]  # the trainer's (offload resets the allocator's peak within a step)
    device = torch.cuda.current_device()
    events, end = replay(snapshot["device_traces"][device], start)
    top = max(range(len(events)), key=lambda i: events[i]["allocated"])
    peak = events[top]["allocated"]
    print(f"allocated at the step's start {start / 1e9:.3f} GB, peak {peak / 1e9:.3f} GB (the step's own "
          f"figure: {peak_reported / 1e9:.3f} GB), at its end {end / 1e9:.3f} GB")
    # the way up: each time the allocated bytes first pass a level between the start and the peak
    levels = [start + (peak - start) * q for q in (0.25, 0.5, 0.75, 0.9, 0.95, 0.99)]
    climb, li = [], 0
    for i, e in enumerate(events[:top + 1]):
        while li < len(levels) and e["allocated"] >= levels[li]:
            climb.append({"level": round((levels[li] - start) / max(peak - start, 1), 2), **e})
            li += 1
    for c in climb:
        print(f"  passes {c['level']:.0%} of the climb at event {c['index']}: {c['allocated'] / 1e9:.3f} GB, "
              f"{c['action']} {c['size'] / 1e6:.1f} MB at {c['where']}")
    before = events[max(0, top - ours.context):top + 1]
    print("the events up to the peak:")
    for e in before:
        print(f"  {e['index']:>8} {e['action']:<15} {e['size'] / 1e6:9.1f} MB -> {e['allocated'] / 1e9:.3f} GB  "
              f"{e['where']}")
    # what was live at the peak, by where it was allocated (allocs not yet freed by then)
    live: dict[int, dict] = {}
    trace = snapshot["device_traces"][device]
    for e in trace[:events[top]["index"] + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    by_where: dict[str, int] = {}
    for e in live.values():
        key = where(e.get("frames"))
        by_where[key] = by_where.get(key, 0) + int(e["size"])
    ranked = sorted(by_where.items(), key=lambda kv: -kv[1])[:15]
    print("allocated during the step and live at the peak, by where:")
    for key, b in ranked:
        print(f"  {b / 1e6:9.1f} MB  {key}")
    if ours.name:
        print("wrote", write_result(ours.name, {
            "argv": rest, "start_bytes": start, "peak_bytes": peak, "max_memory_allocated": peak_reported,
            "end_bytes": end, "climb": climb, "before_peak": before,
            "live_at_peak_by_where": [{"where": k, "bytes": b} for k, b in ranked]}))


if __name__ == "__main__":
    main()
