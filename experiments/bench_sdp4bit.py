"""SDP4Bit's collectives vs NCCL bf16 ones, on 2 GPUs treated as 2 "nodes" (node_size=1).

For each message size (MiB of fp32-equivalent gradient: n = size / 4 values):
  - TLq-HS reduce-scatter (Hadamard, int4 quantize, all-to-all, dequantize, sum, inverse Hadamard,
    everything included) vs dist.reduce_scatter_tensor of the same n values in bf16;
  - qWD all-gather (delta, 4-bit quantize, all-gather codes + scales, dequantize, add) vs
    dist.all_gather_into_tensor of the bf16 shards;
median of CUDA-event timings after warm-up (the slowest rank's median), and speed-ups. Also a
correctness check at one size: relative L2 error vs the exact fp32 reduce-scatter (with and without
the Hadamard transform), qWD's error and replica identity. Results go to
experiments/results/sdp4bit_<transport>.json, transport from AGOQ_TRANSPORT (nvlink | sockets).

    AGOQ_TRANSPORT=nvlink torchrun --nproc-per-node 2 experiments/bench_sdp4bit.py [--out DIR]
    # NCCL over sockets: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo
    # CPU smoke run (gloo): torchrun --nproc-per-node 2 experiments/bench_sdp4bit.py --sizes-mib 0.25,1 --no-write
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.runtime.comm.sdp4bit import (  # noqa: E402
    WEIGHT_BLOCK,
    exact_reduce_scatter,
    qwd_all_gather,
    shard_bounds,
    tlq_hs_reduce_scatter,
)
from experiments.collective_timing import median_ms_across_ranks  # noqa: E402
from experiments.record import write_result  # noqa: E402

MiB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,4,16,64,256,1024",
                        help="message sizes, MiB of fp32-equivalent gradient (comma-separated)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--node-size", type=int, default=1, help="ranks per 'node' (1: every GPU is a node)")
    parser.add_argument("--check-mib", type=float, default=64, help="size of the correctness check")
    parser.add_argument("--transport", default=None, help="default: AGOQ_TRANSPORT, else guessed from NCCL_* vars")
    parser.add_argument("--lanes", type=int, default=4,
                        help="also time TLq-HS and qWD with their codes spread over this many communicators "
                             "(agoq/runtime/comm/lanes.py); 1 to skip")
    parser.add_argument("--out", default=None, help="also write the result file into this folder")
    parser.add_argument("--no-write", action="store_true", help="print only (smoke runs)")
    args = parser.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes_mib.split(",") if s]
    if not args.sizes or min(args.sizes) <= 0 or args.iters < 1 or args.warmup < 0:
        parser.error("sizes must be positive, iters >= 1, warmup >= 0")
    if args.transport is None:
        sockets = os.environ.get("NCCL_NET") == "Socket" or os.environ.get("NCCL_P2P_DISABLE") == "1"
        args.transport = os.environ.get("AGOQ_TRANSPORT") or ("sockets" if sockets else "nvlink")
    return args


def _numel(mib: float, world: int) -> int:
    """Values in `mib` MiB of fp32, rounded to whole 128-groups per rank (plain collectives need equal shards)."""
    unit = 128 * world
    return max(unit, int(mib * MiB / 4) // unit * unit)


def _gather_into(out: torch.Tensor, x: torch.Tensor) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x)


def measure(mib: float, args, world: int, rank: int, device: torch.device) -> dict:
    n = _numel(mib, world)
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    grad = torch.randn(n, device=device, generator=gen).to(torch.bfloat16)
    out = torch.empty(n // world, device=device, dtype=torch.bfloat16)
    seeds = iter(range(10**9))
    row = {"fp32_mib": mib, "numel": n}
    row["tlq_hs_ms"] = median_ms_across_ranks(
        lambda: tlq_hs_reduce_scatter(grad, node_size=args.node_size, seed=next(seeds)), args.iters, args.warmup, cuda)
    row["bf16_reduce_scatter_ms"] = median_ms_across_ranks(lambda: _reduce_scatter_into(out, grad), args.iters,
                                                           args.warmup, cuda)
    if args.lanes > 1:
        row[f"tlq_hs_lanes{args.lanes}_ms"] = median_ms_across_ranks(
            lambda: tlq_hs_reduce_scatter(grad, node_size=args.node_size, seed=next(seeds), lanes=args.lanes),
            args.iters, args.warmup, cuda)
    del grad, out
    torch.manual_seed(7)  # the same weights on every rank
    prev = torch.randn(n, device=device).to(torch.bfloat16)
    start, end = shard_bounds(n, world)[rank]
    new = prev[start:end].float() + 1e-3 * torch.randn(end - start, device=device, generator=gen)
    full = torch.empty(n, device=device, dtype=torch.bfloat16)
    shard = new.to(torch.bfloat16)
    row["qwd_ms"] = median_ms_across_ranks(lambda: qwd_all_gather(new, prev, seed=next(seeds)), args.iters,
                                           args.warmup, cuda)
    row["bf16_all_gather_ms"] = median_ms_across_ranks(lambda: _gather_into(full, shard), args.iters, args.warmup,
                                                       cuda)
    if args.lanes > 1:
        row[f"qwd_lanes{args.lanes}_ms"] = median_ms_across_ranks(
            lambda: qwd_all_gather(new, prev, seed=next(seeds), lanes=args.lanes), args.iters, args.warmup, cuda)
        row[f"all_gather_speedup_lanes{args.lanes}"] = row["bf16_all_gather_ms"] / row[f"qwd_lanes{args.lanes}_ms"]
        row[f"reduce_scatter_speedup_lanes{args.lanes}"] = (row["bf16_reduce_scatter_ms"]
                                                            / row[f"tlq_hs_lanes{args.lanes}_ms"])
    row["reduce_scatter_speedup"] = row["bf16_reduce_scatter_ms"] / row["tlq_hs_ms"]
    row["all_gather_speedup"] = row["bf16_all_gather_ms"] / row["qwd_ms"]
    shard_n = n // world
    row["bytes_per_rank"] = {  # what each rank hands to the collective
        "tlq_hs": n // 2 + 4 * (n // 128), "bf16_reduce_scatter": 2 * n,
        "qwd": shard_n // 2 + 4 * -(-shard_n // WEIGHT_BLOCK), "bf16_all_gather": 2 * shard_n,
    }
    return row


def check(mib: float, args, world: int, rank: int, device: torch.device) -> dict:
    """Errors vs exact at one size: TLq-HS with/without Hadamard (Gaussian and outlier gradients), qWD."""
    n = _numel(mib, world)
    gen = torch.Generator(device=device).manual_seed(2000 + rank)
    result = {"fp32_mib": mib, "numel": n}
    gauss = torch.randn(n, device=device, generator=gen)
    spiky = gauss.clone()
    spiky[::128] = 50.0  # one outlier per 128-group
    for name, g in (("gaussian", gauss), ("outliers", spiky)):
        exact = exact_reduce_scatter(g)
        for h in (True, False):
            got = tlq_hs_reduce_scatter(g, node_size=args.node_size, hadamard=h, seed=3)
            err = torch.stack([(got - exact).norm() ** 2, exact.norm() ** 2]).double()
            dist.all_reduce(err)
            result[f"tlq_hs_rel_err_{name}_{'hadamard' if h else 'plain'}"] = float((err[0] / err[1]).sqrt())
    torch.manual_seed(7)
    prev = torch.randn(n, device=device)
    start, end = shard_bounds(n, world)[rank]
    new = prev[start:end] + 1e-3 * torch.randn(end - start, device=device, generator=gen)
    full = qwd_all_gather(new, prev, seed=5)
    err = torch.stack([(full[start:end] - new).norm() ** 2, (new - prev[start:end]).norm() ** 2]).double()
    dist.all_reduce(err)
    result["qwd_rel_err_of_delta"] = float((err[0] / err[1]).sqrt())
    reference = full.clone()
    dist.broadcast(reference, 0)
    same = torch.tensor([int(torch.equal(full, reference))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    result["qwd_replicas_identical"] = bool(same.item())
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    try:
        rows = []
        for mib in args.sizes:
            row = measure(mib, args, world, rank, device)
            rows.append(row)
            if rank == 0:
                print(f"{mib:8.2f} MiB  TLq-HS {row['tlq_hs_ms']:8.3f} ms vs bf16 RS "
                      f"{row['bf16_reduce_scatter_ms']:8.3f} ms ({row['reduce_scatter_speedup']:.2f}x)   "
                      f"qWD {row['qwd_ms']:8.3f} ms vs bf16 AG "
                      f"{row['bf16_all_gather_ms']:8.3f} ms ({row['all_gather_speedup']:.2f}x)", flush=True)
                if args.lanes > 1:
                    k = args.lanes
                    print(f"{'':13s}{k} lanes: TLq-HS {row[f'tlq_hs_lanes{k}_ms']:8.3f} ms "
                          f"({row[f'reduce_scatter_speedup_lanes{k}']:.2f}x)   qWD {row[f'qwd_lanes{k}_ms']:8.3f} ms "
                          f"({row[f'all_gather_speedup_lanes{k}']:.2f}x)", flush=True)
            if cuda:
                torch.cuda.empty_cache()
        correctness = check(args.check_mib, args, world, rank, device)
        if rank == 0:
            print("check:", correctness, flush=True)
            figures = {
                "world": world, "node_size": args.node_size, "transport": args.transport,
                "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
                "gradient_dtype": "bfloat16", "weights_dtype": "bfloat16 replicas, fp32 master shard",
                "iters": args.iters, "warmup": args.warmup, "lanes": args.lanes, "sizes": rows, "check": correctness,
            }
            if not args.no_write:
                print("wrote", write_result(f"sdp4bit_{args.transport}", figures, args.out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
