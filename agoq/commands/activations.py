"""Run one forward+backward per activation policy on random tokens and report the bytes each decoder layer
keeps for backward (measured by saved-tensor hooks, and predicted from shapes), the weight-gradient relative
L2 error against the unmodified model, and the step time.

examples:
  agoq activations                              # llama-tiny on the CPU, every preset
  agoq activations probe --seq 4096 --policy bf16,agoq-paper
"""

from __future__ import annotations

import argparse
import json

from agoq.runtime.activations.policy import as_policy
from agoq.commands.arguments import positive_int
from agoq.files import check_output_file, read_json_object, write_atomic
from agoq.progress import progress_bar
from agoq.units import dtype_from_name, format_bytes

HELP = "compare activation policies on a model: bytes kept for backward, gradient error, step time"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `agoq activations`'s arguments to `parser` and set its function."""
    parser.add_argument("model", nargs="?", default="llama-tiny",
                        help="preset (llama-tiny, probe, llama-3.2-1b, llama-3-8b) or a HuggingFace config.json "
                          "(default: llama-tiny)")
    parser.add_argument("--policy", default="bf16,agoq-paper,int8,int4,int2",
                        help="comma-separated presets or policy .json files (default: all presets)")
    parser.add_argument("--batch", type=positive_int, default=2, help="micro-batch size (default 2)")
    parser.add_argument("--seq", type=positive_int, default=64, help="sequence length in tokens (default 64)")
    parser.add_argument("--layers", type=positive_int, default=None, help="use only this many decoder layers")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp16"), default="auto",
                        help="compute dtype (default auto: bf16 on a GPU, fp32 on the CPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed steps per policy (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the figures as JSON to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from agoq.models import build  # the model and the profiler's kernels load when the command runs, not with --help
    from agoq.models.size_check import check_spec_fits
    from agoq.profiler import compare_policies
    from agoq.profiler.model_source import check_layers

    check_layers(args.model, args.layers)
    if args.out:
        check_output_file(args.out, "--out")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":  # bf16 where it is the training dtype (GPUs); the CPU computes in float32
        args.dtype = "fp32" if torch.device(device).type == "cpu" else "bf16"
    dtype = dtype_from_name(args.dtype)
    policies = []
    for item in args.policy.split(","):
        item = item.strip()
        if item.endswith(".json"):
            policies.append(as_policy(read_json_object(item, "policy file")))
        else:
            policies.append(as_policy(item))
    check_spec_fits(args.model, args.layers, device=device, dtype=args.dtype, seq_len=args.seq,
                    fewer_layers="--layers N to measure only the first N layers")
    model = build(args.model, dtype=dtype, device=device, seed=args.seed, num_layers=args.layers)
    if args.seq > model.config.max_position_embeddings:
        raise ValueError(f"--seq {args.seq} exceeds the model's max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1), device=device, generator=gen)
    bar = progress_bar(total=len(policies), desc="policies", unit="policy", enabled=not args.quiet)

    def progress(name):
        bar.set_postfix_str(name)
        bar.update(0)

    reports = compare_policies(model, policies, ids[:, :-1], ids[:, 1:], repeats=args.repeats,
                               progress=lambda n: (progress(n), bar.update(1)))
    bar.close()
    base = next((r for r in reports if r.policy == "bf16"), None)
    cfg = model.config
    print(f"\nmodel {cfg.name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"micro-batch {args.batch} x {args.seq}, {args.dtype}, on {device}")
    print(f"{'policy':>14s} {'kept/layer':>12s} {'vs bf16':>8s} {'pred-err':>10s} {'grad err':>9s} {'step':>9s}")
    for r in reports:
        per_layer = r.total_bytes / len(r.layer_bytes)
        ratio = f"{r.total_bytes / base.total_bytes:.3f}" if base else "-"
        print(f"{r.policy:>14s} {format_bytes(per_layer):>12s} {ratio:>8s} {r.prediction_error:>9.2%} "
              f"{r.grad_rel_error:>9.4f} {r.step_seconds * 1e3:>7.1f}ms")
    print("\nbytes kept per kind (all layers):")
    for r in reports:
        print(f"  {r.policy}: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(r.by_kind.items())))
    if args.out:
        out = {"model": cfg.to_dict(), "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "device": device,
               "reports": [{**r.__dict__, "total_bytes": r.total_bytes, "prediction_error": r.prediction_error}
                           for r in reports]}
        write_atomic(args.out, json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0
