"""Which tensor kinds hurt the gradients most at 4 bits, beside the LAAQ paper's per-kind table.

Two measurements on the probe model (random weights, random tokens, bf16 on one GPU), both against
every layer kept at 16 bits through the same LAAQ runtime:
  - all_layers: relative L2 error of all weight gradients when that kind is 4-bit in every layer
    (the other kinds kept) -- the paper's setting, one run per kind;
  - single_layer_mean: the mean over layers of the profile's sensitivity (only one layer at 4 bits).
agoq's `attention` kind keeps q, k and v together, so it stands beside the paper's Q, K and V;
the GEMM-input kinds (qkv_input, o_proj_input, ffn1_input, ffn2_input) beside "GEMM input".

    python experiments/profile_kind_ranking.py                 # one H200, under a minute
    python experiments/profile_kind_ranking.py --model llama-tiny   # CPU check

Writes experiments/results/profile_kind_ranking.json with both rankings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.runtime.activations.policy import KINDS, RECOMPUTE, ActivationPolicy  # noqa: E402
from agoq.runtime.activations.saved_bytes import find_decoder_layers  # noqa: E402
from agoq.profiler.model_source import load_model, token_batches, vocab_size  # noqa: E402
from agoq.profiler.sensitivity import (  # noqa: E402
    Measurement,
    SensitivityMeter,
    measure_chunk,
    reference_kind,
)
from experiments.record import write_result  # noqa: E402

PAPER = {"Q": 0.14, "K": 0.15, "V": 0.059, "SiLU": 0.051, "GEMM input": 0.026, "RMSNorm": 0.003}
PAPER_NAME = {"attention": "Q, K, V", "silu_input": "SiLU", "norm_input": "RMSNorm", "qkv_input": "GEMM input",
              "o_proj_input": "GEMM input", "ffn1_input": "GEMM input", "ffn2_input": "GEMM input"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="probe")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 on CUDA, 64 on the CPU")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--bits", type=int, default=4)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    device = "cuda" if cuda else "cpu"
    model = load_model(args.model, dtype="bf16" if cuda else "fp32", device=device)
    seq = args.seq_len or (4096 if cuda else 64)
    meter = SensitivityMeter(model, token_batches(vocab_size(model), args.batches, args.micro_batch, seq, 0, device))
    layers = len(find_decoder_layers(model))
    start = time.perf_counter()
    all_layers, single = {}, {}
    for kind in sorted(KINDS, key=reference_kind):
        reference = reference_kind(kind)
        policy = ActivationPolicy(default={reference: RECOMPUTE, kind: args.bits}, name=f"{kind}-{args.bits}")
        all_layers[kind] = meter.policy_error(policy, reference)
        rows = measure_chunk(meter, [Measurement(i, kind, str(args.bits), "int") for i in range(layers)])
        single[kind] = sum(r["sensitivity"] for r in rows) / layers
        print(f"{kind:>13s}: all layers {all_layers[kind]:.4f}, one layer (mean) {single[kind]:.5f}", flush=True)
    seconds = time.perf_counter() - start
    rank_all = sorted(all_layers, key=all_layers.get, reverse=True)
    rank_single = sorted(single, key=single.get, reverse=True)
    paper_rank = sorted(PAPER, key=PAPER.get, reverse=True)
    print(f"\nranking at {args.bits} bits ({args.model}, {seconds:.0f} s):")
    print(f"  agoq, all layers : " + " > ".join(f"{k} {all_layers[k]:.3f}" for k in rank_all))
    print(f"  agoq, one layer  : " + " > ".join(f"{k} {single[k]:.4f}" for k in rank_single))
    print(f"  paper            : " + " > ".join(f"{k} {PAPER[k]}" for k in paper_rank))
    figures = {
        "model": args.model, "bits": args.bits, "seq_len": seq, "micro_batch": args.micro_batch,
        "batches": args.batches, "seconds": seconds,
        "agoq_all_layers": {k: all_layers[k] for k in rank_all},
        "agoq_single_layer_mean": {k: single[k] for k in rank_single},
        "agoq_ranking_all_layers": [{"kind": k, "paper_kind": PAPER_NAME[k], "error": all_layers[k]} for k in rank_all],
        "paper": PAPER, "paper_ranking": paper_rank,
        "note": "agoq's attention kind quantizes q, k and v together; weights and tokens are random",
    }
    print(f"wrote {write_result('profile_kind_ranking' + ('' if args.model == 'probe' else '_' + args.model), figures)}")


if __name__ == "__main__":
    main()
