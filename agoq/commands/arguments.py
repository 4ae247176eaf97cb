"""The command line's value types (argparse `type=` functions) and the one way a command's errors are reported."""

from __future__ import annotations

import argparse
import sys

from agoq.units import parse_size


def _checked(text: str, cast, ok, unreadable: str, out_of_range: str):
    """cast(text), or argparse's error saying what was expected: `unreadable` when it is no number,
    `out_of_range` when ok(value) is false (NaN included)."""
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{unreadable}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{out_of_range}, got {value}")
    return value


def integer(text: str) -> int:
    """argparse type: any integer (a seed)."""
    return _checked(text, int, lambda v: True, "expected an integer", "expected an integer")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _checked(text, int, lambda v: v >= 1, "expected a positive integer", "expected a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _checked(text, int, lambda v: v >= 0, "expected an integer >= 0", "expected an integer >= 0")


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, such as 11,9,7,5."""
    values = [v.strip() for v in text.split(",")]
    if not text.strip() or any(not v for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 11,9,7,5, got {text!r}")
    return [positive_int(v) for v in values]


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    return _checked(text, float, lambda v: v > 0, "expected a number", "expected a number > 0")


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    return _checked(text, float, lambda v: v >= 0, "expected a number", "expected a number >= 0")


def not_retired(text: str) -> str:
    """argparse type of a parallel mode or layout word: the word itself, except agoq's retired own sharded path
    ("sharded"), which is refused with what to run instead (agoq.vocabulary.SHARDED_RETIRED)."""
    from agoq.vocabulary import SHARDED, SHARDED_RETIRED

    if text == SHARDED:
        raise argparse.ArgumentTypeError(SHARDED_RETIRED)
    return text


def size_bytes(text: str) -> int:
    """argparse type: a size such as 30GiB, 1.5GB or 4096, in bytes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size_gb(text: str) -> int:
    """argparse type: a size > 0 in bytes, written as a number of GB (10^9 bytes: 64, 0.5) or with its unit
    (64GB, 30GiB, 512MiB); rounded to a whole byte (agoq.units.parse_size)."""
    text = str(text).strip()
    try:
        float(text)
    except ValueError:
        plain = False
    else:
        plain = True
    try:
        size = parse_size(f"{text}GB" if plain else text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (a plain number is GB)" if plain else str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size > 0 (a number of GB, or with a unit: 64GB, 30GiB), "
                                         f"got {text!r}")
    return size


def flag(field: str) -> str:
    """The command line's name of a search request's field (agoq.search.request): time_cap -> --time-cap."""
    return "--" + field.replace("_", "-")


def request_field(field: str):
    """argparse type of a search request's field: the field's own rule (agoq.search.request), which the
    dashboard's plan service reads its JSON with too; a refusal is argparse's error in the rule's words."""
    from agoq.search.request import BadField, read_field

    def parse(text: str):
        try:
            return read_field(field, text)
        except BadField as e:
            raise argparse.ArgumentTypeError(e.problem) from None
    parse.__name__ = field
    return parse


def path_error(e: OSError) -> str:
    """One line for an OSError about a path: 'PATH: what is wrong' (both paths of a rename or link)."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    return f"{paths}: {e.strerror or e}; check the path and its permissions"


def run_command(args: argparse.Namespace, name: str) -> int:
    """Run a parsed command (`args.func`); bad input prints `name: error: ...` and returns exit code 2.

    Bad input is a ValueError (UnicodeDecodeError included), NotImplementedError, a FileNotFoundError raised with
    a message, or any OSError about a path the user gave (a missing file, a file where a folder belongs, no
    permission, a read-only file system): those name their path. An OSError about no path is no input's fault
    and is raised."""
    try:
        return args.func(args)
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise
        print(f"{name}: error: {path_error(e) if e.filename is not None else e}", file=sys.stderr)
        return 2
    except (ValueError, NotImplementedError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2


def run_module(module, argv: list[str] | None, name: str) -> int:
    """Parse `argv` with a command module's own parser (its `configure` and docstring) and run it, as
    `run_command` does: `python -m agoq.train` and `agoq demo`'s stages go through here."""
    parser = argparse.ArgumentParser(prog=name, description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.configure(parser)
    return run_command(parser.parse_args(argv), name)
