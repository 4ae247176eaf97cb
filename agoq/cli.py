"""The `agoq` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agoq.files import write_atomic
from agoq.units import format_bytes

DESCRIPTION = """agoq: low-bit activations, gradients and communication for LLM training.

commands:
  profile       measure a model on this hardware: bytes, error and sensitivity per layer and kind
  search        turn a profile and a memory budget into a plan (MILP, Optuna)
  train         train a model, in plain bf16 or with a plan, on one GPU or many (torchrun)
  dashboard     serve a web page of profiles, plans, searches and runs
  demo          the whole loop on a tiny model on the CPU, then the dashboard command to see it
  activations   compare activation policies on a model: bytes kept for backward per layer and kind
                (measured and predicted), weight-gradient error and step time
  policy        print an activation policy as JSON (a preset, or stage-aware bits for pipelines)
"""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def size_bytes(text: str) -> int:
    """argparse type: a size such as 30GiB, 1.5GB or 4096, in bytes."""
    from agoq.units import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_activations(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from agoq.activations.policy import as_policy
    from agoq.models import build
    from agoq.profiler import compare_policies

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":  # bf16 where it is the training dtype (GPUs); the CPU computes in float32
        args.dtype = "fp32" if torch.device(device).type == "cpu" else "bf16"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    policies = []
    for item in args.policy.split(","):
        item = item.strip()
        if item.endswith(".json"):
            policies.append(as_policy(json.loads(Path(item).read_text())))
        else:
            policies.append(as_policy(item))
    model = build(args.model, dtype=dtype, device=device, seed=args.seed, num_layers=args.layers)
    if args.seq > model.config.max_position_embeddings:
        raise ValueError(f"--seq {args.seq} exceeds the model's max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1), device=device, generator=gen)
    bar = tqdm(total=len(policies), desc="policies", unit="policy", disable=args.quiet, file=sys.stderr)

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


def cmd_policy(args: argparse.Namespace) -> int:
    from agoq.activations.policy import preset, stage_aware_policy

    if args.in_flight:
        counts = [int(c) for c in args.in_flight.split(",")]
        if args.layers is None:
            raise ValueError("--in-flight needs --layers (the model's number of decoder layers)")
        policy = stage_aware_policy(counts, args.layers)
    else:
        policy = preset(args.name)
    text = policy.to_json() + "\n"
    if args.out:
        write_atomic(args.out, text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


# Stage commands live beside their stage: each module has `configure(parser)`, which adds the
# arguments and sets `func`, and a one-line `HELP`.
STAGE_COMMANDS = {
    "profile": "agoq.profiler.command",
    "search": "agoq.search.command",
    "train": "agoq.train.command",
    "dashboard": "dashboard.command",
    "demo": "agoq.demo",
}


def _add_stage_commands(sub) -> None:
    import importlib

    for name, module_name in STAGE_COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # that stage is not installed in this build
        parser = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure(parser)


def _installed_version() -> str:
    from agoq.environment import agoq_version

    return agoq_version()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agoq", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"agoq {_installed_version()}")
    sub = parser.add_subparsers(dest="command")
    _add_stage_commands(sub)

    act = sub.add_parser("activations", help="compare activation policies on a model",
                         description="Run one forward+backward per activation policy on random tokens and report "
                                     "the bytes each decoder layer keeps for backward (measured by saved-tensor "
                                     "hooks, and predicted from shapes), the weight-gradient relative L2 error "
                                     "against the unmodified model, and the step time.")
    act.add_argument("model", nargs="?", default="llama-tiny",
                     help="preset (llama-tiny, probe, llama-3.2-1b, llama-3-8b) or a HuggingFace config.json "
                          "(default: llama-tiny)")
    act.add_argument("--policy", default="bf16,agoq-paper,int8,int4,int2",
                     help="comma-separated presets or policy .json files (default: all presets)")
    act.add_argument("--batch", type=positive_int, default=2, help="micro-batch size (default 2)")
    act.add_argument("--seq", type=positive_int, default=64, help="sequence length in tokens (default 64)")
    act.add_argument("--layers", type=positive_int, default=None, help="use only this many decoder layers")
    act.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp16"), default="auto",
                     help="compute dtype (default auto: bf16 on a GPU, fp32 on the CPU)")
    act.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    act.add_argument("--repeats", type=positive_int, default=3, help="timed steps per policy (median reported)")
    act.add_argument("--seed", type=int, default=0)
    act.add_argument("--out", default=None, help="also write the figures as JSON to this file")
    act.add_argument("--quiet", action="store_true", help="no progress bar")
    act.set_defaults(func=cmd_activations)

    pol = sub.add_parser("policy", help="print an activation policy as JSON",
                         description="Print a preset activation policy, or the stage-aware one for pipeline "
                                     "parallelism (B_i = max(4, floor(4 N_1 / N_i)) bits for stage i holding N_i "
                                     "micro-batches in flight), as JSON.")
    pol.add_argument("name", nargs="?", default="agoq-paper", help="preset: bf16, agoq-paper, int8, int4, int2")
    pol.add_argument("--in-flight", default=None, help="in-flight micro-batches per stage, e.g. 11,9,7,5")
    pol.add_argument("--layers", type=positive_int, default=None, help="number of decoder layers (with --in-flight)")
    pol.add_argument("--out", default=None, help="write to this file instead of standard output")
    pol.set_defaults(func=cmd_policy)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `agoq` console command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    return run_command(args, f"agoq {args.command}")


def run_command(args: argparse.Namespace, name: str) -> int:
    """Run a parsed command (`args.func`); bad input prints `name: error: ...` and returns exit code 2."""
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError, json.JSONDecodeError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
