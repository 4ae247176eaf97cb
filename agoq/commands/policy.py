"""Print a preset activation policy, or the stage-aware one for pipeline parallelism
(B_i = max(4, floor(4 N_1 / N_i)) bits for stage i holding N_i micro-batches in flight), as JSON.

examples:
  agoq policy agoq-paper
  agoq policy --in-flight 11,9,7,5 --layers 32 --out policy.json
"""

from __future__ import annotations

import argparse
import sys

from agoq.runtime.activations.policy import preset, stage_aware_policy
from agoq.commands.arguments import positive_int, positive_int_list
from agoq.files import check_output_file, write_atomic

HELP = "print an activation policy as JSON"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `agoq policy`'s arguments to `parser` and set its function."""
    parser.add_argument("name", nargs="?", default="agoq-paper", help="preset: bf16, agoq-paper, int8, int4, int2")
    parser.add_argument("--in-flight", type=positive_int_list, default=None,
                        help="in-flight micro-batches per stage, e.g. 11,9,7,5")
    parser.add_argument("--layers", type=positive_int, default=None, help="number of decoder layers (with --in-flight)")
    parser.add_argument("--out", default=None, help="write to this file instead of standard output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_output_file(args.out, "--out")
    if args.in_flight:
        counts = args.in_flight
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
