"""Timing a collective the same way in every multi-process benchmark."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def median_ms_across_ranks(fn, iters: int, warmup: int = 3, cuda: bool = True) -> float:
    """Milliseconds of fn(): each rank's median over `iters` runs after `warmup`, then the slowest rank's.

    Ranks are lined up before every run; on CUDA the run is timed with events, else with a host clock.
    """
    times = []
    sync = torch.zeros(1, device="cuda" if cuda else "cpu")
    for i in range(warmup + iters):
        dist.all_reduce(sync)  # line the ranks up (a barrier that needs no device guess)
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)
