"""Time the collectives training uses, per message size, on the process group it will use.

Paths, each timed where it applies:
  all_reduce      nccl-fp32, nccl-bf16 (torch.distributed), quangrad8 (agoq.quantized_all_reduce)
  reduce_scatter  nccl-fp32, nccl-bf16, sdp4bit (TLq-HS, agoq.runtime.comm.sdp4bit.tlq_hs_reduce_scatter)
  all_gather      nccl-fp32, nccl-bf16, sdp4bit (qWD, agoq.runtime.comm.sdp4bit.qwd_all_gather)
The "nccl-*" paths are torch.distributed's own collectives on whatever backend the group has (NCCL
on GPUs, gloo on the CPU; the `backend` column says which). `message_bytes` is the fp32 gradient
bytes the collective moves (the full tensor, not a shard); `seconds` is each rank's median over
`iters` runs after a warm-up, ranks lined up before each run, then the slowest rank's median.

`spawn_collectives(world_size)` starts that many local processes; `profile_collectives()` runs on an
existing group (under torchrun), every rank calling it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from agoq.profiler.kernel_time import median_seconds
from agoq.progress import progress_bar
from agoq.profiler.local_group import run_on_local_group

OPS = ("all_reduce", "reduce_scatter", "all_gather")
PATHS = ("nccl-fp32", "nccl-bf16", "quangrad8", "sdp4bit")
GPU_SIZES = tuple(1 << s for s in range(20, 31, 2))  # 1 MiB, 4 MiB, ..., 1 GiB
CPU_SIZES = (16 << 10, 256 << 10)


def _median_across_ranks(fn, iters: int, device: torch.device, warmup: int = 2) -> float:
    """Seconds of fn(): each rank's median over `iters` runs, then the largest over ranks."""
    sync = torch.zeros(1, device=device)
    mine = median_seconds(fn, device, iters, warmup, before=lambda: dist.all_reduce(sync))  # ranks lined up
    med = torch.tensor([mine], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med)


def _cases(numel: int, world: int, rank: int, device: torch.device):
    """(op, path, function) for every collective timed at one message size."""
    from agoq.runtime.comm.quantized_allreduce import quantized_all_reduce
    from agoq.runtime.comm.sdp4bit import qwd_all_gather, shard_bounds, tlq_hs_reduce_scatter

    gen = torch.Generator(device=device).manual_seed(rank)
    full32 = torch.randn(numel, generator=gen, device=device) * 1e-3
    per = -(-numel // world)
    cases = []
    for path, dtype in (("nccl-fp32", torch.float32), ("nccl-bf16", torch.bfloat16)):
        t = full32.to(dtype)
        big = torch.zeros(per * world, dtype=dtype, device=device)
        small = torch.zeros(per, dtype=dtype, device=device)
        cases.append(("all_reduce", path, lambda t=t: dist.all_reduce(t)))
        cases.append(("reduce_scatter", path, lambda b=big, s=small: dist.reduce_scatter_tensor(s, b)))
        cases.append(("all_gather", path, lambda b=big, s=small: dist.all_gather_into_tensor(b, s)))
    q = full32.clone()
    cases.append(("all_reduce", "quangrad8", lambda: quantized_all_reduce(q)))
    cases.append(("reduce_scatter", "sdp4bit", lambda: tlq_hs_reduce_scatter(full32, seed=0)))
    start, end = shard_bounds(numel, world)[rank]
    new_shard = full32[start:end] + 1e-4
    cases.append(("all_gather", "sdp4bit", lambda: qwd_all_gather(new_shard, full32, seed=0)))
    return cases


def profile_collectives(sizes: list[int], iters: int = 5, progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Time every (op, path) at every message size (bytes of fp32) on the default process group.

    Every rank must call it; returns (rows, failures), the same on every rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    rows, failures = [], []
    bar = None
    if progress and rank == 0:
        bar = progress_bar(total=len(sizes) * 9, desc="collectives", unit="case")
    warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)  # names differ by version
    for size in sizes:
        numel = max(size // 4, world * 128)
        for op, path, fn in _cases(numel, world, rank, device):
            ok = torch.ones(1, device=device)
            try:
                seconds = _median_across_ranks(fn, iters, device)
            except Exception as e:  # noqa: BLE001 - an unsupported collective is recorded, the rest go on
                failures.append({"what": f"collective {op} {path} {numel * 4} bytes",
                                 "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})
                seconds = None
                ok.zero_()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if seconds is not None and bool(ok.item()):
                rows.append({"op": op, "path": path, "world_size": world, "message_bytes": numel * 4,
                             "seconds": seconds, "backend": backend})
            if bar is not None:
                bar.update(1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    return rows, failures


def _collect_rank(rank: int, sizes: list[int], iters: int, progress: bool) -> dict:
    """One rank's part of `spawn_collectives` (agoq.profiler.local_group runs it in the joined group)."""
    rows, failures = profile_collectives(sizes, iters, progress=progress)
    return {"rows": rows, "failures": failures}


def spawn_collectives(world_size: int, sizes: list[int] | None = None, iters: int | None = None,
                      use_cuda: bool | None = None, progress: bool = False) -> tuple[list[dict], list[dict]]:
    """Start `world_size` local processes (NCCL, one GPU each, or gloo on the CPU) and time the
    collectives (rank 0 shows a progress bar with `progress`); returns (rows, failures)."""
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    sizes = list(sizes or (GPU_SIZES if use_cuda else CPU_SIZES))
    iters = iters or (10 if use_cuda else 3)
    result = run_on_local_group(_collect_rank, (sizes, iters, progress), world_size, use_cuda,
                                "collective profiling")
    return result["rows"], result["failures"]
