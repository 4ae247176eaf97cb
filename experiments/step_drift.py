"""Whether a training step slows down as a run goes on: `agoq train`'s own step, many times, with what could grow.

Takes `agoq train`'s arguments (a plan included), builds the run as `agoq train` does (no run folder is written) and
times `--steps` steps one by one (synchronised), printing every `--every` steps the median step of that block and the
counters that could explain a drift: the caching allocator's device allocations, frees and retries, its reserved
bytes, the process's resident memory, garbage collections, and with offload the pinned pool's chunks and the layers
fetched on demand. Writes experiments/results/NAME.json with every step's seconds.

    python experiments/step_drift.py probe --plan plan.json --data DATA --steps 120 --name step_drift_probe
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoq.train.trainer import Trainer  # noqa: E402
from experiments.profile_train_step import trainer_from_arguments  # noqa: E402
from experiments.record import write_result  # noqa: E402


def counters(trainer: Trainer) -> dict:
    out = {"gc_collections": sum(s["collections"] for s in gc.get_stats()),
           "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        out.update({k: int(stats.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                                     "num_sync_all_streams", "reserved_bytes.all.current")})
    offload = trainer.prepared.offload
    if offload is not None:
        out.update({"pool_chunks": len(offload.pool.chunks), "pool_bytes": offload.pool.capacity_bytes,
                    "fetched_on_demand": offload.stats.fetched_on_demand,
                    "fetched_ahead": offload.stats.fetched_ahead})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--name", default=None, help="write experiments/results/NAME.json")
    ours, rest = ap.parse_known_args()
    trainer = trainer_from_arguments(rest, "step_drift")
    seconds, blocks = [], []
    for step in range(ours.steps):
        t = time.perf_counter()
        trainer.step(step)  # synchronises at its end
        seconds.append(time.perf_counter() - t)
        if (step + 1) % ours.every == 0:
            block = seconds[-ours.every:] if step + 1 > ours.every else seconds[1:]
            row = {"steps": [step + 2 - len(block), step + 1], "median_ms": statistics.median(block) * 1e3,
                   "min_ms": min(block) * 1e3, "max_ms": max(block) * 1e3, **counters(trainer)}
            blocks.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    if ours.name:
        print("wrote", write_result(ours.name, {"argv": rest, "steps": ours.steps, "blocks": blocks,
                                                "step_seconds": seconds}))


if __name__ == "__main__":
    main()
