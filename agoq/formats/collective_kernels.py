"""The profile's collective kernels (profile.json `collective_kernels`, docs/formats.md; version 2): the quantized
collectives' own compute timed in one process (agoq.profiler.collective_kernels), which a what-if from a profile
without measured collectives (one GPU) adds to each quantized path's wire time (agoq.search.whatif).

    {"version": 2,
     "world_size": W, "node_size": G,   the representative ranks the kernels were run for (2 and 2: one node)
     "device": "NVIDIA H200" | "cpu",   where they were timed
     "repeats": r,                      timed runs per row (the median is kept)
     "rows": [{"op": "all_reduce" | "reduce_scatter" | "all_gather",
               "path": "quangrad8" | "sdp4bit" | "int8-weights" | "int4-weights" | "tlq4"
                       | "sdp4bit-int4-level",   (op, path) in PATHS
               "message_bytes": b,      float32 bytes of the whole tensor (4 per value), an integer > 0
               "seconds": s}]}          the kernels' median seconds at that size, a number > 0

Version 2 adds the row (op, path) = INT4_LEVEL, ("reduce_scatter", "sdp4bit-int4-level"): TLq-HS's int4 level across
nodes on its own, its `message_bytes` the float32 bytes of the values that level touches (the node's 1/G of the
tensor, timed as if it were the whole), which the 2 ranks of one node the other rows are run for never run. Version 1
(PATHS_V1: every other path) stays readable: such a section simply lacks that path; a version 1 row naming it is
refused. `kernel_rows(header)` returns the checked rows ([] for a profile without the section: older profiles stay
readable and price as before); `section(...)` builds it (version 2). This module is the section's one owner.
"""

from __future__ import annotations

import math
from typing import Any

VERSIONS = (1, 2)
NAME = "collective_kernels"
INT4_LEVEL = ("reduce_scatter", "sdp4bit-int4-level")  # TLq-HS's int4 level across nodes, timed on its own
PATHS_V1 = (("all_reduce", "quangrad8"), ("reduce_scatter", "sdp4bit"), ("all_gather", "sdp4bit"),
            ("all_gather", "int8-weights"), ("all_gather", "int4-weights"), ("all_reduce", "tlq4"))
PATHS = PATHS_V1 + (INT4_LEVEL,)
PATHS_OF = {1: PATHS_V1, 2: PATHS}  # the (op, path) a section of each version may name


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_row(row: Any, where: str, version: int = VERSIONS[-1]) -> dict:
    """A row {op, path, message_bytes, seconds} of a section of `version` checked; ValueError naming the field
    otherwise."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a collective kernel row is an object, got {type(row).__name__}")
    key = (row.get("op"), row.get("path"))
    paths = PATHS_OF[version]
    if key not in paths:
        newer = (f" (version {version} of the section has no such rows: only a version {VERSIONS[-1]} section "
                 "does; profile again with this agoq)") if key in PATHS else ""
        raise ValueError(f"{where}: (op, path) must be one of {', '.join(f'{o} {p}' for o, p in paths)}, got "
                         f"{row.get('op')!r} {row.get('path')!r}{newer}")
    if not _is_int(row.get("message_bytes"), 1):
        raise ValueError(f"{where}.message_bytes: must be an integer > 0, got {row.get('message_bytes')!r}")
    seconds = row.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (seconds > 0 and
                                                                                   math.isfinite(seconds)):
        raise ValueError(f"{where}.seconds: must be a finite number > 0, got {seconds!r}")
    return {"op": row["op"], "path": row["path"], "message_bytes": int(row["message_bytes"]),
            "seconds": float(seconds)}


def kernel_rows(header: dict, where: str = "profile.json") -> list[dict]:
    """The checked rows of a profile header's `collective_kernels` of any version in VERSIONS ([] where it has
    none). ValueError naming the field for a malformed section (re-run `agoq profile --resume` to time them again)."""
    sec = header.get(NAME)
    if sec is None:
        return []
    if not isinstance(sec, dict) or not isinstance(sec.get("rows"), list):
        raise ValueError(f"{where}: {NAME}: expected {{'version': {VERSIONS[-1]}, 'world_size': W, 'node_size': G, "
                         "'device': ..., 'rows': [...]}")
    version = sec.get("version")
    if isinstance(version, bool) or version not in VERSIONS:
        raise ValueError(f"{where}: {NAME}.version {version!r} is not one this agoq reads "
                         f"({', '.join(map(str, VERSIONS))}): upgrade agoq, or profile again with this one")
    for name in ("world_size", "node_size"):
        if not _is_int(sec.get(name), 1):
            raise ValueError(f"{where}: {NAME}.{name}: must be an integer >= 1, got {sec.get(name)!r}")
    return [check_row(r, f"{where}: {NAME}.rows[{i}]", version) for i, r in enumerate(sec["rows"])]


def section(rows: list[dict], world_size: int, node_size: int, device: str, repeats: int) -> dict:
    """The `collective_kernels` section (version 2) holding `rows` (each checked), run for `world_size` ranks in
    nodes of `node_size` on `device`, median of `repeats` runs."""
    return {"version": VERSIONS[-1], "world_size": int(world_size), "node_size": int(node_size),
            "device": str(device), "repeats": int(repeats),
            "rows": [check_row(r, f"{NAME}.rows[{i}]") for i, r in enumerate(rows)]}


__all__ = ["kernel_rows", "section", "check_row", "PATHS", "PATHS_V1", "PATHS_OF", "INT4_LEVEL", "VERSIONS", "NAME"]
