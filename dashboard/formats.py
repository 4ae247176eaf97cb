"""How the pages write values read from agoq's files. The files themselves are read through agoq.formats' read-only
views (agoq.formats.views: one reader, the format's owner's, per file), never here."""

from __future__ import annotations

import math
from typing import Any

from agoq import units


def number(value: Any) -> float | None:
    """A finite float from a JSON/CSV value, or None."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def format_bytes(n: Any) -> str:
    """Bytes in binary units with two decimals ('3.21 MiB'), or an en dash when unknown."""
    return units.format_bytes(n, digits=2)
