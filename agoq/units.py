"""Sizes and dtypes as people write them ("30GiB", "512MB", "bf16") and as agoq prints them."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# the dtype names agoq accepts -> the name of the torch dtype (torch is imported only when a dtype is made, so
# that the commands that compute nothing with torch start without it)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

EXCERPT_CHARS = 40  # the most of a bad value an error quotes
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5}


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """repr(value), cut to `limit` characters and marked so when longer: what an error quotes of bad input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_size(text: str | int) -> int:
    """Bytes from a size such as 30GiB, 1.5GB, 512MiB, 2PiB, 4096 (plain bytes: no unit), rounded to a whole
    byte; raises ValueError, also for a size above 0 that rounds to 0 bytes (0.5 is half a byte: a unit was meant)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0 bytes, got {text}")
        return text
    # one way to match any text (no nested or adjacent repeats of the same characters): linear in its length
    m = re.fullmatch(r"((?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE]\+?[0-9]+)?)\s*([a-zA-Z]*)", str(text).strip())
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {excerpt(text)}: write a number with an optional unit (B, KB, MB, GB, "
                         "TB, PB or KiB, MiB, GiB, TiB, PiB), e.g. 30GiB, 1.5GB, 512MiB, 4096 or 1e9 (bytes)")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(number):
        raise ValueError(f"size {excerpt(text)} is too large to be a number of bytes")
    if number > 0 and round(number) == 0:
        why = "" if m.group(2) else " (a number without a unit is bytes)"
        raise ValueError(f"size {excerpt(text)} reads as {number:g} bytes{why}, less than one byte, which rounds to "
                         f"0: for more than 0 bytes write its unit, e.g. {m.group(1)}GB or {m.group(1)}GiB")
    return int(round(number))


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of "bf16", "fp16" or "fp32"; ValueError naming the choices otherwise."""
    try:
        torch_name = DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}") from None
    import torch

    return getattr(torch, torch_name)


def format_bytes(n: Any, digits: int = 1) -> str:
    """A byte count in binary units: '512 B', '3.2 MiB', '14.6 GiB' (`digits` decimals); an en dash for
    None or a non-finite value (unknown)."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "\u2013"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"


def format_bytes_apart(a: int, b: int, digits: int = 1, most: int = 3) -> tuple[str, str]:
    """Two byte counts as format_bytes writes them, with `digits` decimals or more (up to `most`) where fewer
    would make different counts read alike ('1.301 MiB' and '1.326 MiB', not '1.3 MiB' twice), and as exact
    byte counts where even `most` decimals would; equal counts read alike."""
    for d in range(digits, max(digits, most) + 1):
        x, y = format_bytes(a, d), format_bytes(b, d)
        if x != y or a == b:
            return x, y
    return f"{int(a)} B", f"{int(b)} B"
