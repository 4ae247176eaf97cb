"""Gradient all-reduce on several GPUs: agoq's 8-bit all-reduce against NCCL and torch's DDP hooks.

Run under torchrun, one process per GPU; set AGOQ_TRANSPORT to name the transport in the results
(e.g. nvlink, or sockets with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo):

    torchrun --nproc-per-node 2 experiments/bench_allreduce.py [--max-mib 1024] [--reps 20]

Collectives (gradient of N MiB in fp32, quantization included in agoq's time):
  nccl_fp32, nccl_bf16 (same values in bf16), agoq_8bit (quantized_all_reduce of the fp32 tensor, with
  the transport it picks: symmetric memory on one node), agoq_8bit_collectives (forced onto NCCL
  all-to-all + all-gather). Both transports must give the same bytes; the run checks it.
QuanGrad's fused accumulate kernel (rank 0): 8-bit buffer += fp32 gradient, against the torch ops.
For the socket stand-in of a network, set AGOQ_ALLREDUCE_TRANSPORT=collectives too (symmetric memory
would ride NVLink).
DDP backward of one parameter of N MiB in one bucket, per communication hook:
  ddp_default (fp32 all-reduce), ddp_bf16_compress, ddp_quantization_pertensor, ddp_quangrad.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    quantization_hooks,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.runtime.comm.quangrad import quangrad_hook  # noqa: E402
from agoq.runtime.comm.quantized_allreduce import quantized_all_reduce  # noqa: E402
from experiments.collective_timing import median_ms_across_ranks  # noqa: E402
from experiments.record import write_result  # noqa: E402


class _OneParameter(nn.Module):
    """A module whose backward produces one gradient of `numel` values (the bucket under test)."""

    def __init__(self, numel: int):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(numel, device="cuda"))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.p * c).sum()


def ddp_time(numel: int, hook, reps: int) -> float:
    """Milliseconds of DDP forward + backward (gradient all-reduced through `hook`) of one numel-value bucket."""
    module = _OneParameter(numel)
    ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=numel * 4 / 2**20 + 1,
                                              device_ids=[torch.cuda.current_device()])
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    c = torch.randn(numel, device="cuda")

    def step():
        ddp(c).backward()  # through DDP's forward: that is what arms the reducer and its hook
        module.p.grad = None

    return median_ms_across_ranks(step, reps)


def accumulate_timing(reps: int, mib: int = 256) -> dict:
    """QuanGrad's accumulate (8-bit buffer += fp32 gradient of `mib` MiB): fused kernel vs torch ops."""
    from agoq.runtime.comm.quangrad import accumulate_reference
    from agoq.runtime.comm.quangrad_triton import accumulate_triton

    n, block = mib * 2**20 // 4, 256
    grad = torch.randn(n, device="cuda")
    codes = torch.full((n,), 127, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(n // block, device="cuda")
    out = {}
    for name, fn in [("fused_kernel", accumulate_triton), ("torch_ops", accumulate_reference)]:
        c, sc = codes.clone(), scales.clone()
        fn(c, sc, grad, block)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(c, sc, grad, block)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        out[f"{name}_ms"] = ms
        out[f"{name}_GBps"] = (n * 4 + 2 * n + 2 * 4 * (n // block)) / ms / 1e6  # grad + codes in/out + scales
    c1, s1, c2, s2 = codes.clone(), scales.clone(), codes.clone(), scales.clone()
    for _ in range(3):
        accumulate_triton(c1, s1, grad, block)
        accumulate_reference(c2, s2, grad, block)
    out["bytes_equal_reference"] = bool(torch.equal(c1, c2) and torch.equal(s1, s2))
    out["MiB_fp32_gradient"] = mib
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-mib", type=int, default=1)
    parser.add_argument("--max-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP hook comparison")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    transport = os.environ.get("AGOQ_TRANSPORT", "default")
    sizes = []
    mib = args.min_mib
    while mib <= args.max_mib:
        sizes.append(mib)
        mib *= 4
    rows = []
    g = torch.Generator(device="cuda").manual_seed(rank)
    for mib in sizes:
        n = mib * 2**20 // 4
        grad = torch.randn(n, device="cuda", generator=g)
        exact = grad.double()
        dist.all_reduce(exact)
        test = grad.clone()
        quantized_all_reduce(test, min_numel=0)
        rel_err = ((test.double() - exact).norm() / exact.norm()).item()
        work32, work16 = grad.clone(), grad.to(torch.bfloat16)
        forced = os.environ.get("AGOQ_ALLREDUCE_TRANSPORT")
        os.environ["AGOQ_ALLREDUCE_TRANSPORT"] = "collectives"
        via_collectives = grad.clone()
        quantized_all_reduce(via_collectives, min_numel=0)
        collectives_ms = median_ms_across_ranks(lambda: quantized_all_reduce(work32, min_numel=0), args.reps)
        if forced is None:
            del os.environ["AGOQ_ALLREDUCE_TRANSPORT"]
        else:
            os.environ["AGOQ_ALLREDUCE_TRANSPORT"] = forced
        row = {"MiB_fp32": mib, "numel": n, "agoq_rel_err": rel_err,
               "transports_bit_identical": bool(torch.equal(test, via_collectives)),
               "nccl_fp32_ms": median_ms_across_ranks(lambda: dist.all_reduce(work32), args.reps),
               "nccl_bf16_ms": median_ms_across_ranks(lambda: dist.all_reduce(work16), args.reps),
               "agoq_8bit_ms": median_ms_across_ranks(lambda: quantized_all_reduce(work32, min_numel=0), args.reps),
               "agoq_8bit_collectives_ms": collectives_ms}
        if transport == "nvlink":  # both ways of pushing rows over symmetric memory, same run
            for push in ("stores", "copy-engine"):
                os.environ["AGOQ_ALLREDUCE_PUSH"] = push
                check = grad.clone()
                quantized_all_reduce(check, min_numel=0)
                row[f"agoq_8bit_push_{push}_ms"] = median_ms_across_ranks(
                    lambda: quantized_all_reduce(work32, min_numel=0), args.reps)
                row[f"push_{push}_bit_identical"] = bool(torch.equal(check, test))
                if rank == 0:
                    print(f"  push {push}: {row[f'agoq_8bit_push_{push}_ms']:.3f} ms, bit-identical "
                          f"{row[f'push_{push}_bit_identical']}", flush=True)
            del os.environ["AGOQ_ALLREDUCE_PUSH"]
        if not args.no_ddp:
            for name, hook in [("ddp_default", None), ("ddp_bf16_compress", default_hooks.bf16_compress_hook),
                               ("ddp_quantization_pertensor", quantization_hooks.quantization_pertensor_hook),
                               ("ddp_quangrad", quangrad_hook)]:
                row[f"{name}_ms"] = ddp_time(n, hook, max(3, args.reps // 4))
        work32.copy_(grad)  # the timed calls left graphs for this tensor: a replay must give the same bytes
        quantized_all_reduce(work32, min_numel=0)
        work32.copy_(grad)
        quantized_all_reduce(work32, min_numel=0)
        row["replay_bit_identical"] = bool(torch.equal(work32, test))
        row["speedup_vs_fp32"] = row["nccl_fp32_ms"] / row["agoq_8bit_ms"]
        row["speedup_vs_bf16"] = row["nccl_bf16_ms"] / row["agoq_8bit_ms"]
        rows.append(row)
        if rank == 0:
            print(f"  8-bit via collectives {collectives_ms:.3f} ms; transports bit-identical: "
                  f"{row['transports_bit_identical']}; graph replay bit-identical: {row['replay_bit_identical']}", flush=True)
            print(f"{mib:5d} MiB  fp32 {row['nccl_fp32_ms']:8.3f}  bf16 {row['nccl_bf16_ms']:8.3f}  "
                  f"agoq8 {row['agoq_8bit_ms']:8.3f} ms  x{row['speedup_vs_fp32']:.2f} vs fp32  "
                  f"x{row['speedup_vs_bf16']:.2f} vs bf16  err {rel_err:.4f}  "
                  + "  ".join(f"{k[4:-3]} {v:.3f}" for k, v in row.items() if k.startswith("ddp_")), flush=True)
        del grad, exact, test, work32, work16
    accumulate = accumulate_timing(args.reps) if rank == 0 else None
    if rank == 0:
        print("accumulate:", accumulate, flush=True)
        from agoq.runtime.comm.symmetric_transport import _WORKSPACES

        print("wrote", write_result(f"allreduce_{world}gpu_{transport}",
                                    {"world": world, "transport": transport,
                                     "symmetric_memory_used": bool(_WORKSPACES), "rows": rows,
                                     "quangrad_accumulate": accumulate}, args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
