"""Two GPUs: PyTorch FSDP2 in bf16 against FSDP2 with agoq's collectives (SDP4Bit's TLq-HS gradient
reduce-scatter, int8 / int4 weight all-gathers), on the ~1.1 B probe model. agoq's own sharded optimizer
(SDP4Bit: variants sharded_sdp4bit, sharded_sdp4bit_int4) was retired; the committed results files keep its runs.

`agoq train` runs under torchrun on the same model (the "probe" preset: hidden 2048, 16 layers, FFN 5632,
vocabulary 32000), data (tinyshakespeare.txt, bytes), seed, batch and steps:
  fsdp_bf16             --parallel fsdp: fully_shard per decoder layer, float32 shards, bf16 compute,
                        bf16 gradient reduce-scatter and weight all-gather (FSDP2's own collectives)
  fsdp_tlqhs            the same with the gradient reduce-scatter as TLq-HS (Hadamard-32, int8 inside
                        the node; FSDP2 averages after it) from float32 gradients
  fsdp_tlqhs_int4       the same with every GPU treated as a node (--node-size 1): gradients in int4
  fsdp_int8_gather      FSDP2 with its weight all-gather (forward and backward) in int8 blocks of 256 values
                        (agoq train --weight-gather int8); fsdp_int8_gather_tlqhs_int4 with TLq-HS int4 too;
                        fsdp_int4_gather_tlqhs_int4 with the weights in int4 after Hadamard-32
(on 4 processes as 2 nodes of 2, --transports nodes: fsdp_tlqhs_nodes, fsdp_int4_gather_tlqhs_nodes, hsdp_bf16,
hsdp_quangrad8, hsdp_sdp4bit, hsdp_sdp4bit_int8_gather; experiments/emulated_nodes.py)
once over NVLink and once over NCCL's socket transport on loopback (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo; AGOQ_ALLREDUCE_TRANSPORT=collectives keeps every agoq collective
on NCCL's plain collectives, which read those variables; NCCL_NVLS_ENABLE=0 leaves NVLink multicast off).
Figures per run: tokens/s (median over the steps after the first 10), peak bytes per rank
(torch.cuda.max_memory_allocated, max over steps), validation loss after the last step; per quantized run
its ratio to fsdp_bf16's. Goals (issue 13): validation loss within 1 % of fsdp_bf16's; agoq's peak not
above fsdp_bf16's.

Writes experiments/results/train_fsdp_<transport>.json and run folders (no checkpoints) under
experiments/results/runs/.

GPU (2 x H200; one transport per command, each well under 10 minutes at the defaults):
    python experiments/train_fsdp.py --transports nvlink
    python experiments/train_fsdp.py --transports sockets --steps 100
GPU (4 x H200 as 2 nodes of 2):
    python experiments/train_fsdp.py --transports nodes --nproc 4 --variants fsdp_bf16,fsdp_tlqhs_nodes,\
      fsdp_int4_gather_tlqhs_nodes,hsdp_bf16,hsdp_quangrad8,hsdp_sdp4bit,hsdp_sdp4bit_int8_gather
CPU check (gloo, llama-tiny, 12 steps; the transports collapse to one):
    python experiments/train_fsdp.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import RESULTS, write_result
from experiments.train_runs import (
    common_args,
    compare,
    tiny_check,
    tiny_shakespeare,
    train_variant,
)

GOAL = 0.01
BASELINE = "fsdp_bf16"
VARIANTS = {
    "fsdp_bf16": ["--parallel", "fsdp"],
    "fsdp_tlqhs": ["--parallel", "fsdp", "--gradients", "sdp4bit"],
    "fsdp_tlqhs_int4": ["--parallel", "fsdp", "--gradients", "sdp4bit", "--node-size", "1"],
    # FSDP2 with its weight all-gather in int8 blocks (agoq.runtime.comm.fsdp_weight_gather), alone and with TLq-HS int4
    "fsdp_int8_gather": ["--parallel", "fsdp", "--weight-gather", "int8"],
    "fsdp_int8_gather_tlqhs_int4": ["--parallel", "fsdp", "--weight-gather", "int8", "--gradients", "sdp4bit",
                                    "--node-size", "1"],
    # weights gathered as 4-bit codes after Hadamard-32, gradients TLq-HS int4: the least FSDP2 traffic
    "fsdp_int4_gather_tlqhs_int4": ["--parallel", "fsdp", "--weight-gather", "int4", "--gradients", "sdp4bit",
                                    "--node-size", "1"],
    # nodes of 2 ranks (--transports nodes, 4 processes: 2 nodes of 2): TLq-HS int8 inside a node, int4 across, and
    # HSDP (shards within a node, replicas across) with FSDP2's exact all-reduce or its quantized ones across nodes
    "fsdp_tlqhs_nodes": ["--parallel", "fsdp", "--gradients", "sdp4bit", "--node-size", "2"],
    "fsdp_int4_gather_tlqhs_nodes": ["--parallel", "fsdp", "--weight-gather", "int4", "--gradients", "sdp4bit",
                                     "--node-size", "2"],
    "hsdp_bf16": ["--parallel", "hsdp", "--node-size", "2"],
    "hsdp_quangrad8": ["--parallel", "hsdp", "--node-size", "2", "--gradients", "quangrad8"],
    "hsdp_sdp4bit": ["--parallel", "hsdp", "--node-size", "2", "--gradients", "sdp4bit"],
    "hsdp_sdp4bit_int8_gather": ["--parallel", "hsdp", "--node-size", "2", "--gradients", "sdp4bit",
                                 "--weight-gather", "int8"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="probe", help="agoq model preset or config.json (default probe, 1.1 B)")
    parser.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per run (default 2)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank and step (default 2)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--transports", default="nvlink",
                        help="nvlink, sockets, nodes (2 nodes of 2: --nproc 4), comma-separated")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer in every variant")
    parser.add_argument("--tiny", action="store_true", help="CPU check with gloo: llama-tiny, 12 steps")
    parser.add_argument("--out", default=str(RESULTS / "runs"))
    parser.add_argument("--name", default=None, help="results name (default train_fsdp[_TRANSPORT])")
    args = parser.parse_args(argv)

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose among {', '.join(VARIANTS)}")
    model, name, device, eval_every, eval_batches = args.model, "train_fsdp", [], max(1, args.steps // 3), 16
    transports = args.transports.split(",")
    if len(transports) == 1:
        name += f"_{transports[0]}"
    name = args.name or name
    if args.tiny:
        model, name, device, eval_every, eval_batches, transports = tiny_check(args, "train_fsdp")
    data = tiny_shakespeare(args.data)
    common = common_args(model, data, seq_len=args.seq_len, micro_batch=args.micro_batch, steps=args.steps,
                         lr=args.lr, eval_every=eval_every, eval_batches=eval_batches, device=device)
    if args.compile:
        common.append("--compile")
    figures: dict = {"nproc": args.nproc, "model": model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                     "steps": args.steps, "compile": args.compile, "runs": {}, "comparisons": {}}
    for transport in transports:
        for variant in variants:
            figures["runs"][f"{transport}/{variant}"] = train_variant(
                common, VARIANTS[variant], Path(args.out) / f"{name}_{transport}_{variant}", nproc=args.nproc,
                transport=transport)
        base = figures["runs"].get(f"{transport}/{BASELINE}")
        for variant in variants:
            if base is not None and variant != BASELINE:
                figures["comparisons"][f"{transport}/{variant}_vs_{BASELINE}"] = compare(
                    figures["runs"][f"{transport}/{variant}"], base, GOAL)
    if args.tiny:
        path = Path(args.out) / f"{name}.json"
        path.write_text(json.dumps(figures, indent=2) + "\n")
    else:
        path = write_result(name, figures)
    for key, run in figures["runs"].items():
        print(f"{key}: {run['median_tokens_per_s']:.0f} tokens/s, peak "
              f"{max(run['peak_bytes_per_rank']) / 2**30:.2f} GiB/rank, val loss {run['final_val_loss']:.4f}")
    for key, c in figures["comparisons"].items():
        print(f"{key}: val loss {c['relative_difference']:.2%} ({'met' if c['met'] else 'NOT met'}), throughput x"
              f"{c['throughput_ratio']:.2f}, peak {'<=' if c['peak_not_above_baseline'] else '>'} baseline")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
