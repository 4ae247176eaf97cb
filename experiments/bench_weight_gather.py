"""FSDP2's weight all-gather in bf16 against agoq's int8 / int4 gather (agoq.runtime.comm.fsdp_weight_gather): the
time of one decoder layer's unshard and the time and peak memory of whole training steps.

Under torchrun, every rank:
  layer unshard   one probe-sized decoder layer (float32 shards, bf16 compute), `fully_shard`ed alone:
                  `unshard()` (pre-all-gather hook, all-gather, copy-out and post-all-gather hook) then `reshard()`,
                  median ms over --iters; for int8 / int4 also the hooks alone (quantize every weight's shard,
                  dequantize W copies of it into the unsharded weights; no communication), median ms
  steps           the whole model under `agoq train`'s fsdp strategy (agoq.train.parallel.apply_parallel, one
                  unit per decoder layer, AdamW on float32 shards): --steps forward + backward + optimizer steps
                  on random tokens, median ms over the steps after the first two, tokens/s over all ranks, and
                  the peak bytes per rank (torch.cuda.max_memory_allocated from the model's build on)
per variant (bf16: FSDP2's own gather; int8; int4 with Hadamard-32). Rank 0 prints a table and writes
experiments/results/bench_weight_gather.json (--name) through experiments/record.py.

GPU (2 x H200, well under 10 minutes each; NVLink, then NCCL's socket transport on loopback):
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 experiments/bench_weight_gather.py
    NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo \\
        torchrun --nproc-per-node 2 experiments/bench_weight_gather.py --name bench_weight_gather_sockets
One GPU (torchrun --nproc-per-node 1): the all-gather moves nothing, so the figures are what the hooks add.
CPU check (gloo, llama-tiny, a few iterations; times are not meaningful there):
    torchrun --nproc-per-node 2 experiments/bench_weight_gather.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from experiments.record import write_result

VARIANTS = ("bf16", "int8", "int4")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _timed(fn, device: torch.device, repeats: int) -> list[float]:
    """ms of each of `repeats` calls of fn, every rank in step (a barrier before each)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _layer_unshard(model_name: str, variant: str, device: torch.device, iters: int) -> dict:
    """One decoder layer's unshard + reshard, and (int8 / int4) its gather hooks alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from agoq.models import build
    from agoq.runtime.comm.fsdp_weight_gather import apply_weight_gather

    model = build(model_name, dtype=torch.float32, device=device, num_layers=1)
    layer = model.model.layers[0]
    if variant != "bf16":
        apply_weight_gather(layer, bits=8 if variant == "int8" else 4)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    with torch.no_grad():  # FSDP2's lazy initialisation (streams, the root)
        model(torch.zeros(1, 8, dtype=torch.long, device=device))

    def unshard():
        layer.unshard()
        layer.reshard()

    out = {"unshard_ms": statistics.median(_timed(unshard, device, iters)),
           "weight_values": sum(p.numel() for p in layer.parameters() if p.dim() >= 2)}
    if variant != "bf16":
        out["hooks_ms"] = statistics.median(_timed(_hooks(layer, mesh, mp.param_dtype), device, iters))
    return out


def _hooks(layer, mesh, dtype: torch.dtype):
    """A call running the pre- and post-all-gather hooks of every wrapped weight of `layer` (the gathered bytes
    stood in for by this rank's input repeated world times), into preallocated unsharded weights."""
    world = mesh.size()
    locals_ = [p.to_local() for p in layer.parameters() if hasattr(p.to_local(), "fsdp_pre_all_gather")]
    outs = [torch.empty(t._spec.shape, dtype=dtype, device=t.device) for t in locals_]

    def run():
        for t, out in zip(locals_, outs):
            (buf,), meta = t.fsdp_pre_all_gather(mesh)
            t.fsdp_post_all_gather((buf.repeat(world),), meta, dtype, out=out)
    return run


def _steps(model_name: str, variant: str, device: torch.device, steps: int, micro_batch: int, seq_len: int,
           world) -> dict:
    """`steps` training steps of the whole model under agoq train's fsdp strategy."""
    from agoq.models import build
    from agoq.train.config import OptimizerConfig
    from agoq.train.parallel import apply_parallel

    gc.collect()  # the previous variant's FSDP2 modules (reference cycles through their hooks)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(model_name, dtype=torch.float32, device=device, seed=0)
    vocab = model.config.vocab_size
    strategy = apply_parallel(model, mode="fsdp", world=world, device=device, gradients="bf16", dtype=dtype,
                              micro_batch=micro_batch, seq_len=seq_len, grad_accum=1, weight_gather=variant)
    optimizer = strategy.build_optimizer(OptimizerConfig(lr=1e-4, weight_decay=0.0), seed=0)
    g = torch.Generator().manual_seed(1000 + world.rank)
    ids = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g).to(device)

    def step():
        strategy.zero_grad()
        strategy.loss_module(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step(strategy.gradients(fused=False), 1.0)

    times = _timed(step, device, steps)
    ms = statistics.median(times[2:] if len(times) > 2 else times)
    out = {"step_ms": ms, "tokens_per_s": world.size * micro_batch * seq_len / ms * 1e3,
           "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    return out


def _table(figures: dict) -> str:
    base = figures["steps"].get("bf16")
    lines = ["variant  unshard ms  hooks ms  step ms  tokens/s  x bf16  peak GiB/rank"]
    for v in figures["variants"]:
        u, s = figures["layer_unshard"][v], figures["steps"][v]
        hooks = f"{u['hooks_ms']:8.2f}" if "hooks_ms" in u else "       -"
        ratio = f"{s['tokens_per_s'] / base['tokens_per_s']:6.2f}" if base else "     -"
        peak = f"{s['peak_bytes'] / 2**30:8.2f}" if s["peak_bytes"] is not None else "       -"
        lines.append(f"{v:7s}  {u['unshard_ms']:10.2f}  {hooks}  {s['step_ms']:7.1f}  {s['tokens_per_s']:8.0f}  "
                     f"{ratio}  {peak}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="probe", help="agoq model preset or config.json (default probe, 1.1 B)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--iters", type=int, default=30, help="unshards timed per variant (default 30)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per variant (default 8; 2 warm up)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank and step (default 2)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--tiny", action="store_true", help="CPU check with gloo: llama-tiny, a few iterations")
    parser.add_argument("--name", default=None, help="results name (default bench_weight_gather[_tiny])")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants takes a comma-separated list of {', '.join(VARIANTS)}, got {args.variants!r}")
    if args.tiny:
        args.model, args.iters, args.steps, args.seq_len = "llama-tiny", 3, 3, 32

    from agoq.train.parallel import join_world

    if "WORLD_SIZE" not in os.environ:
        print("bench_weight_gather: run it under torchrun, e.g. "
              "torchrun --nproc-per-node 2 experiments/bench_weight_gather.py", file=sys.stderr)
        return 2
    if int(os.environ["WORLD_SIZE"]) == 1 and not dist.is_initialized():
        # one process: FSDP2's all-gather moves nothing, so the figures are the gather hooks' own cost
        if not args.tiny:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo" if args.tiny else "nccl")
    world = join_world("cpu" if args.tiny else None)
    device = torch.device("cuda", world.local_rank) if world.backend == "nccl" else torch.device("cpu")
    figures = {"model": args.model, "world": world.size, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
               "iters": args.iters, "train_steps": args.steps, "steps": {}, "layer_unshard": {},
               "variants": variants}
    for v in variants:
        figures["layer_unshard"][v] = _layer_unshard(args.model, v, device, args.iters)
    for v in variants:
        figures["steps"][v] = _steps(args.model, v, device, args.steps, args.micro_batch, args.seq_len, world)
    if world.rank == 0:
        print(_table(figures))
        path = write_result(args.name or ("bench_weight_gather_tiny" if args.tiny else "bench_weight_gather"),
                            figures)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
