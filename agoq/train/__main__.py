"""`python -m agoq.train ...` is `agoq train ...` (and `torchrun ... -m agoq.train ...` launches it on every rank)."""

import sys

from agoq.commands import train
from agoq.commands.arguments import run_module


def main(argv: list[str] | None = None) -> int:
    """Parse `agoq train`'s arguments and run it; bad input exits with code 2 and a message."""
    return run_module(train, argv, "agoq train")


if __name__ == "__main__":
    sys.exit(main())
