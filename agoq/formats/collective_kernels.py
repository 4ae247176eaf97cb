"""The profile's collective kernels (profile.json `collective_kernels`, docs/formats.md; version 1): the quantized
collectives' own compute timed in one process (agoq.profiler.collective_kernels), which a what-if from a profile
without measured collectives (one GPU) adds to each quantized path's wire time (agoq.search.whatif).

    {"version": 1,
     "world_size": W, "node_size": G,   the representative ranks the kernels were run for (2 and 2: one node)
     "device": "NVIDIA H200" | "cpu",   where they were timed
     "repeats": r,                      timed runs per row (the median is kept)
     "rows": [{"op": "all_reduce" | "reduce_scatter" | "all_gather",
               "path": "quangrad8" | "sdp4bit" | "int8-weights" | "int4-weights" | "tlq4",   (op, path) in PATHS
               "message_bytes": b,      float32 bytes of the whole tensor (4 per value), an integer > 0
               "seconds": s}]}          the kernels' median seconds at that size, a number > 0

`kernel_rows(header)` returns the checked rows ([] for a profile without the section: older profiles stay readable
and price as before); `section(...)` builds it. This module is the section's one owner.
"""

from __future__ import annotations

import math
from typing import Any

VERSIONS = (1,)
NAME = "collective_kernels"
PATHS = (("all_reduce", "quangrad8"), ("reduce_scatter", "sdp4bit"), ("all_gather", "sdp4bit"),
         ("all_gather", "int8-weights"), ("all_gather", "int4-weights"), ("all_reduce", "tlq4"))


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_row(row: Any, where: str) -> dict:
    """A row {op, path, message_bytes, seconds} checked; ValueError naming the field otherwise."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a collective kernel row is an object, got {type(row).__name__}")
    if (row.get("op"), row.get("path")) not in PATHS:
        raise ValueError(f"{where}: (op, path) must be one of "
                         f"{', '.join(f'{o} {p}' for o, p in PATHS)}, got {row.get('op')!r} {row.get('path')!r}")
    if not _is_int(row.get("message_bytes"), 1):
        raise ValueError(f"{where}.message_bytes: must be an integer > 0, got {row.get('message_bytes')!r}")
    seconds = row.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (seconds > 0 and
                                                                                   math.isfinite(seconds)):
        raise ValueError(f"{where}.seconds: must be a finite number > 0, got {seconds!r}")
    return {"op": row["op"], "path": row["path"], "message_bytes": int(row["message_bytes"]),
            "seconds": float(seconds)}


def kernel_rows(header: dict, where: str = "profile.json") -> list[dict]:
    """The checked rows of a profile header's `collective_kernels` ([] where it has none). ValueError naming the
    field for a malformed section (re-run `agoq profile --resume` to time them again)."""
    sec = header.get(NAME)
    if sec is None:
        return []
    if not isinstance(sec, dict) or not isinstance(sec.get("rows"), list):
        raise ValueError(f"{where}: {NAME}: expected {{'version': 1, 'world_size': W, 'node_size': G, 'device': ..., "
                         "'rows': [...]}")
    if sec.get("version") not in VERSIONS:
        raise ValueError(f"{where}: {NAME}.version {sec.get('version')!r} is not one this agoq reads "
                         f"({', '.join(map(str, VERSIONS))}): upgrade agoq, or profile again with this one")
    for name in ("world_size", "node_size"):
        if not _is_int(sec.get(name), 1):
            raise ValueError(f"{where}: {NAME}.{name}: must be an integer >= 1, got {sec.get(name)!r}")
    return [check_row(r, f"{where}: {NAME}.rows[{i}]") for i, r in enumerate(sec["rows"])]


def section(rows: list[dict], world_size: int, node_size: int, device: str, repeats: int) -> dict:
    """The `collective_kernels` section holding `rows` (each checked), run for `world_size` ranks in nodes of
    `node_size` on `device`, median of `repeats` runs."""
    return {"version": VERSIONS[-1], "world_size": int(world_size), "node_size": int(node_size),
            "device": str(device), "repeats": int(repeats),
            "rows": [check_row(r, f"{NAME}.rows[{i}]") for i, r in enumerate(rows)]}


__all__ = ["kernel_rows", "section", "check_row", "PATHS", "VERSIONS", "NAME"]
