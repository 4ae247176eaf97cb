"""Where the time of one 8-bit all-reduce goes: torch profiler table (CPU and CUDA) per op.

    torchrun --nproc-per-node 2 experiments/profile_allreduce.py [--mib 1 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.runtime.comm.quantized_allreduce import quantized_all_reduce  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 256])
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    for mib in args.mib:
        x = torch.randn(mib * 2**20 // 4, device="cuda")
        for _ in range(5):
            quantized_all_reduce(x, min_numel=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            quantized_all_reduce(x, min_numel=0)
        host_ms = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) / 20 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                quantized_all_reduce(x, min_numel=0)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"\n=== {mib} MiB: host time per call {host_ms:.3f} ms (to enqueue), wall {wall_ms:.3f} ms")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=48))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
