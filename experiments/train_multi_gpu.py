"""Two GPUs: DDP with QuanGrad against DDP bf16, FSDP2 with SDP4Bit's TLq-HS against FSDP2 bf16 (exact).

Five `agoq train` runs under torchrun on the same model (experiments/train_llama_byte.json, 128 M
parameters), data (tinyshakespeare.txt, bytes), seed and steps, each rank reading its own share of
every step (the global batch is the same in all four):
  ddp_bf16          DDP, bf16 gradients all-reduced by NCCL
  ddp_quangrad8     8-bit gradient buffer, 8-bit all-reduce (all-to-all, fp32 sum, all-gather)
  fsdp_bf16         FSDP2, its own bf16 reduce-scatter and weight all-gather
  fsdp_tlqhs        FSDP2 with TLq-HS gradients (one node: gradients travel in int8)
  fsdp_int4_gather_tlqhs_int4  FSDP2 with every GPU treated as a node (--node-size 1): TLq-HS int4 gradients,
                    weights gathered in int4 after Hadamard-32 (what replaced agoq's retired own sharded
                    SDP4Bit optimizer, whose runs the committed results files still hold)
once over NVLink and once over NCCL's socket transport on loopback (train_runs.SOCKETS_ENV: NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo, and AGOQ_ALLREDUCE_TRANSPORT=collectives, without
which agoq's 8-bit all-reduce takes its symmetric-memory transport over NVLink). Goal: the quantized runs' final validation
loss within 1 % of their baseline's; throughput (tokens/s, median over the steps after the first 10)
reported as a ratio.

Writes experiments/results/train_2gpu.json and the run folders (no checkpoints) under
experiments/results/runs/.

GPU (2 x H200; 10 runs, about 45 s each, 7-9 minutes in all; one transport per command keeps each under
5 minutes and writes train_2gpu_nvlink.json / train_2gpu_sockets.json):
    python experiments/train_multi_gpu.py --transports nvlink
    python experiments/train_multi_gpu.py --transports sockets
CPU check (gloo, tiny model, NVLink/socket variants collapse to one):
    python experiments/train_multi_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import RESULTS, write_result
from experiments.train_runs import (
    BYTE_MODEL,
    common_args,
    compare,
    tiny_check,
    tiny_shakespeare,
    train_variant,
)

GOAL = 0.01
VARIANTS = {
    "ddp_bf16": ["--parallel", "ddp"],
    "ddp_quangrad8": ["--parallel", "ddp", "--gradients", "quangrad8"],
    "fsdp_bf16": ["--parallel", "fsdp"],
    "fsdp_tlqhs": ["--parallel", "fsdp", "--gradients", "sdp4bit"],
    "fsdp_int4_gather_tlqhs_int4": ["--parallel", "fsdp", "--gradients", "sdp4bit", "--weight-gather", "int4",
                                    "--node-size", "1"],
}
PAIRS = [("ddp_quangrad8", "ddp_bf16"), ("fsdp_tlqhs", "fsdp_bf16"), ("fsdp_int4_gather_tlqhs_int4", "fsdp_bf16")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run (default 2)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank and step (default 4)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--transports", default="nvlink,sockets", help="nvlink, sockets or both (default both)")
    parser.add_argument("--tiny", action="store_true", help="CPU check with gloo: llama-tiny, 12 steps")
    parser.add_argument("--out", default=str(RESULTS / "runs"))
    args = parser.parse_args(argv)

    model, name, device, eval_every, eval_batches = str(BYTE_MODEL), "train_2gpu", [], 50, 16
    transports = args.transports.split(",")
    if len(transports) == 1:  # runs split over several commands keep one result file each
        name += f"_{transports[0]}"
    if args.tiny:
        model, name, device, eval_every, eval_batches, transports = tiny_check(args, "train_2gpu")
    data = tiny_shakespeare(args.data)
    common = common_args(model, data, seq_len=args.seq_len, micro_batch=args.micro_batch, steps=args.steps,
                         lr=args.lr, eval_every=eval_every, eval_batches=eval_batches, device=device)
    figures: dict = {"nproc": args.nproc, "runs": {}, "comparisons": {}}
    for transport in transports:
        for variant, extra in VARIANTS.items():
            figures["runs"][f"{transport}/{variant}"] = train_variant(
                common, extra, Path(args.out) / f"{name}_{transport}_{variant}", nproc=args.nproc, transport=transport)
        for quantized, base in PAIRS:
            figures["comparisons"][f"{transport}/{quantized}_vs_{base}"] = compare(
                figures["runs"][f"{transport}/{quantized}"], figures["runs"][f"{transport}/{base}"], GOAL)
    if args.tiny:
        path = Path(args.out) / f"{name}.json"
        path.write_text(json.dumps(figures, indent=2) + "\n")
    else:
        path = write_result(name, figures)
    for key, c in figures["comparisons"].items():
        print(f"{key}: val loss {c['final_val_loss'][0]:.4f} vs {c['final_val_loss'][1]:.4f} "
              f"({c['relative_difference']:.2%}, {'met' if c['met'] else 'NOT met'}), throughput x"
              f"{c['throughput_ratio']:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
