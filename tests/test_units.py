"""Byte counts printed for people: two different counts never read alike (format_bytes_apart)."""

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
