"""Collective times per message size on this machine's GPUs, as `agoq profile --world-size W` measures them:
all-reduce / reduce-scatter / all-gather for nccl-fp32, nccl-bf16, quangrad8 and sdp4bit.

    python experiments/profile_collectives.py --world-size 2        # 2 x H200, about a minute
    python experiments/profile_collectives.py --world-size 2 --cpu  # gloo check on the CPU

Writes experiments/results/profile_collectives_<W>gpu.json (rows as in collectives.parquet).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.profiler.collectives import spawn_collectives  # noqa: E402
from experiments.record import write_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo processes on the CPU, tiny sizes")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    start = time.perf_counter()
    rows, failures = spawn_collectives(args.world_size, use_cuda=cuda)
    wall = time.perf_counter() - start
    print(f"{'op':>15s} {'path':>10s} " + " ".join(f"{s // 1024:>9d}K" for s in sorted({r['message_bytes'] for r in rows})))
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        for path in ("nccl-fp32", "nccl-bf16", "quangrad8", "sdp4bit"):
            cells = {r["message_bytes"]: r["seconds"] for r in rows if r["op"] == op and r["path"] == path}
            if cells:
                print(f"{op:>15s} {path:>10s} " + " ".join(f"{cells[s] * 1e3:>8.3f}ms" for s in sorted(cells)))
    for f in failures:
        print(f"failed: {f['what']}: {f['error']}")
    name = f"profile_collectives_{args.world_size}{'gpu' if cuda else 'cpu'}"
    print(f"wrote {write_result(name, {'world_size': args.world_size, 'rows': rows, 'failures': failures, 'wall_seconds': wall})}")


if __name__ == "__main__":
    main()
