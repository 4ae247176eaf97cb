"""Byte counts printed for people: two different counts never read alike (format_bytes_apart); dtype names read
as the torch dtypes they name."""

import os
import random
import re

import pytest

from agoq.units import format_bytes_apart

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def read_back(text):
    """(value in bytes, half the last shown digit's step in bytes) of '1.301 MiB' or '1390330 B'."""
    number, unit = re.fullmatch(r"(\d+(?:\.(\d+))?) (B|KiB|MiB|GiB|TiB)", text).group(1, 3)
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number) * UNITS[unit], 0.5 * 10.0 ** -decimals * UNITS[unit]


@pytest.mark.parametrize("seed", [int.from_bytes(os.urandom(4), "little") for _ in range(4)])
def test_different_counts_read_differently(seed):
    rng = random.Random(seed)
    print("seed", seed)
    pairs = [(1363962, 1390330), (1390329, 1390330)]  # the same at one decimal (1.3 MiB); a byte apart
    for _ in range(400):
        a = rng.randint(1, 5 * 2**40)
        b = a + rng.choice([0, 1, rng.randint(1, 999), int(a * rng.uniform(1e-6, 1e-2)) + 1])
        pairs.append((a, b) if rng.random() < 0.5 else (b, a))
    for a, b in pairs:
        x, y = format_bytes_apart(a, b)
        assert (x == y) == (a == b), (a, b, x, y)
        for count, text in ((a, x), (b, y)):
            value, half_step = read_back(text)
            assert abs(value - count) <= half_step * (1 + 1e-9), (count, text)  # each says its own count
        if a != b and x.split()[1] == y.split()[1] and x.split()[1] != "B":  # no more decimals than needed
            unit = UNITS[x.split()[1]]
            decimals = len(x.split()[0].split(".")[1])
            assert decimals == 1 or round(a / unit, decimals - 1) == round(b / unit, decimals - 1), (a, b, x, y)


def test_fewest_decimals_asked_for():
    x, y = format_bytes_apart(3 * 2**20, 5 * 2**20, digits=2)
    assert (x, y) == ("3.00 MiB", "5.00 MiB")


@pytest.mark.parametrize("seed", [int.from_bytes(os.urandom(4), "little") for _ in range(2)])
def test_sizes_up_to_petabytes_are_read(seed):
    """Every unit, decimal (powers of 1000) and binary (of 1024), on fresh numbers, against its own factor."""
    from agoq.units import parse_size

    rng = random.Random(seed)
    factors = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
    for unit, factor in factors.items():
        number = rng.randint(1, 999) + rng.randint(0, 9) / 10
        for text in (f"{number}{unit}", f"{number} {unit.lower()}"):
            assert parse_size(text) == round(number * factor), text


@pytest.mark.parametrize("text", ["0.5", "0.25", ".4", "0.4B"])
def test_less_than_a_byte_is_refused_saying_so(text):
    from agoq.units import parse_size

    with pytest.raises(ValueError) as e:
        parse_size(text)
    message = str(e.value)
    number = float(text.rstrip("B"))
    assert f"reads as {number:g} bytes" in message and "less than one byte" in message, message
    assert "GB" in message  # a unit to write instead
    assert parse_size("0") == 0 and parse_size("1") == 1  # whole bytes are still bytes


def test_budget_of_petabytes_is_refused_as_larger_than_any_gpu():
    """2PiB is read (not 'cannot read size') and refused by the budget's own rule for its size."""
    import argparse

    from agoq.commands.arguments import request_field

    with pytest.raises(argparse.ArgumentTypeError) as e:
        request_field("budget")("2PiB")
    assert "more than any GPU holds" in str(e.value) and "cannot read" not in str(e.value)
    with pytest.raises(argparse.ArgumentTypeError) as e:
        request_field("budget")("0.5")
    assert "0.5 bytes" in str(e.value) and "0.5GB" in str(e.value)


def test_dtype_names_read_as_torch_dtypes():
    """The names agoq accepts against torch's own dtypes (the reference: torch's attributes, named here)."""
    import torch

    from agoq.units import DTYPES, dtype_from_name

    expected = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert {name: dtype_from_name(name) for name in DTYPES} == expected
    for bad in ("bfloat16", "fp8", "", "float32"):
        with pytest.raises(ValueError, match="use one of bf16, fp16, fp32"):
            dtype_from_name(bad)
