"""The `agoq` command: one subcommand per module of agoq.commands (and the dashboard's), dispatched here."""

from __future__ import annotations

import argparse
import importlib
import sys

from agoq.commands.arguments import run_command
from agoq.environment import agoq_version

DESCRIPTION = """agoq: low-bit activations, gradients and communication for LLM training.

the loop:
  profile       measure a model on this hardware: bytes, error and sensitivity per layer and kind
  search        turn a profile and a memory budget into a plan (MILP, Optuna)
  train         train a model, in plain bf16 or with a plan, on one GPU or many (torchrun)
  dashboard     serve a web page of profiles, plans, searches and runs
  demo          what agoq buys on a GPU (predicted from shipped profiles), then the whole loop on a tiny model
                on the CPU and the dashboard command to see it

tools:
  activations   compare activation policies on a model: bytes kept for backward per layer and kind
                (measured and predicted), weight-gradient error and step time
  policy        print an activation policy as JSON (a preset, or stage-aware bits for pipelines)

`agoq COMMAND --help` explains each one.
"""

# Each module has `HELP` (one line), a docstring (the command's --help text) and `configure(parser)`,
# which adds the arguments and sets `func`.
COMMANDS = {
    "profile": "agoq.commands.profile",
    "search": "agoq.commands.search",
    "train": "agoq.commands.train",
    "dashboard": "dashboard.command",
    "demo": "agoq.commands.demo",
    "activations": "agoq.commands.activations",
    "policy": "agoq.commands.policy",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agoq", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"agoq {agoq_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `agoq` console command; returns the exit code. With no command, prints the help."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    return run_command(args, f"agoq {args.command}")


if __name__ == "__main__":
    sys.exit(main())
