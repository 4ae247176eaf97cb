"""Every whole-number flag of agoq profile and agoq train refuses a value that is no whole number by argparse's
error naming the flag and the value (exit 2), never a raw int() error."""

import argparse
import os
import random

import pytest

from agoq.commands import arguments, profile, train

INT_TYPES = (arguments.integer, arguments.positive_int, arguments.non_negative_int)


def _int_flags(module):
    parser = argparse.ArgumentParser(prog=f"agoq {module.__name__.rsplit('.', 1)[1]}")
    module.configure(parser)
    flags = [(a.option_strings[0], a.type) for a in parser._actions if a.option_strings and a.type in INT_TYPES]
    return parser, flags


@pytest.mark.parametrize("module", [profile, train])
def test_every_int_flag_names_itself_and_the_value(module, capsys):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    parser, flags = _int_flags(module)
    assert "--micro-batch" in [f for f, _ in flags] and "--seed" in [f for f, _ in flags]
    for flag, _ in flags:
        bad = rng.choice(["two", f"{rng.randint(1, 99)}.5", "1e3x", "", "0x10"])
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["llama-tiny", flag, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: expected" in err and repr(bad) in err, (flag, err)
        assert "invalid literal" not in err and "Traceback" not in err
    good = rng.randint(1, 10**6)
    for flag, kind in flags:
        assert getattr(parser.parse_args(["llama-tiny", flag, str(good)]), flag[2:].replace("-", "_")) == good


def test_host_budget_is_read_into_bytes_once(capsys):
    """`agoq train --host-budget` takes GB (a plain number, as its metavar says) or a size with its unit, and
    hands the run whole bytes: n nano-GB is n bytes exactly, a unit is agoq.units' (1 GiB = 2**30 bytes); 0, a
    negative size and no size are argparse's error naming the flag (exit 2)."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    parser = argparse.ArgumentParser(prog="agoq train")
    train.configure(parser)
    for _ in range(20):
        n = rng.randrange(1, 10**13)  # bytes, written as GB with nine decimals
        gb = f"{n // 10**9}.{n % 10**9:09d}"
        assert parser.parse_args(["llama-tiny", "--host-budget", gb]).host_budget == n, gb
        k = rng.randrange(1, 4096)
        assert parser.parse_args(["llama-tiny", "--host-budget", f"{k}MiB"]).host_budget == k * 2**20
        assert type(parser.parse_args(["llama-tiny", "--host-budget", f"{k}"]).host_budget) is int
    for bad in ("0", "0GB", "-2", "lots", "2 parsecs"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["llama-tiny", "--host-budget", bad])
        assert e.value.code == 2
        assert "--host-budget" in capsys.readouterr().err
