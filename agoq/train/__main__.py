"""`python -m agoq.train ...` is `agoq train ...` (and `torchrun ... -m agoq.train ...` launches it on every rank).

It loads only the training stage, so it runs where the other stages' dependencies are not installed.
"""

import argparse
import sys

from agoq.cli import run_command
from agoq.train import command


def main(argv: list[str] | None = None) -> int:
    """Parse `agoq train`'s arguments and run it; bad input exits with code 2 and a message."""
    parser = argparse.ArgumentParser(prog="agoq train", description=command.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    command.configure(parser)
    return run_command(parser.parse_args(argv), "agoq train")


if __name__ == "__main__":
    sys.exit(main())
