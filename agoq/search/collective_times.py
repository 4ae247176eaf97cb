"""Seconds of one collective at one message size, read off the profile's measured collectives table
(agoq.profiler.collectives: columns op, path, message_bytes, seconds).

`message_bytes` is, as in the table, the float32 bytes of the whole tensor the collective moves (4 x values,
whatever dtype travels). Between measured sizes the time is interpolated linearly in log(bytes) -> log(seconds);
beyond them it is extrapolated along the nearest two points' slope (one point: proportional to the bytes).
Several ops of one path at one size add up (a path measured as two collectives, e.g. SDP4Bit's reduce-scatter and
its all-gather, is their sum).

Groups: a table may time one collective over several groups of ranks (column `group`; a table without the column
is all "world"): "world", every rank (what the profile measured, or a what-if's N ranks); and, in a what-if's
modelled table over several nodes (agoq.search.whatif), "node", the ranks of one node, and "replicas", one rank per
node, which HSDP's collectives run over (agoq.search.hsdp). Every read is of one group, "world" unless asked.

Kernels: a what-if's modelled table may say, in a column `kernel_seconds`, how much of a row's seconds is the
collective's own compute on the GPU (a quantized path's quantize / Hadamard / dequantize kernels timed in one
process, agoq.search.whatif): `kernel_seconds` reads it, linearly in the bytes (the kernels' time is fixed + per
value), 0 where the table has no such column or row. The layouts do not hide that part under compute
(agoq.search.layouts).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd


WORLD = "world"  # the group of every rank (module docstring)


def of_group(table: Optional[pd.DataFrame], group: str = WORLD) -> Optional[pd.DataFrame]:
    """The table's rows of `group` (a table without a `group` column is all "world")."""
    if table is None or "group" not in table.columns:
        return table if group == WORLD else None
    return table[table["group"] == group]


def has_collective(table: Optional[pd.DataFrame], op: str, path: str, *, group: str = WORLD) -> bool:
    """Whether the table measured `op` on `path` over `group`."""
    table = of_group(table, group)
    return table is not None and bool(len(table)) and bool(((table["path"] == path) & (table["op"] == op)).any())


def collective_seconds(table: Optional[pd.DataFrame], path: str, message_bytes: float,
                       ops: Optional[tuple] = None, *, group: str = WORLD) -> float:
    """Seconds of the collectives `ops` (None: every op the table has) of `path` over `group` for `message_bytes`
    float32 bytes; NaN when the table has no such rows."""
    table = of_group(table, group)
    if table is None or not len(table):
        return float("nan")
    rows = table[table["path"] == path]
    if ops is not None and "op" in rows.columns:
        rows = rows[rows["op"].isin(ops)]
    if not len(rows):
        return float("nan")
    per_size = rows.groupby("message_bytes")["seconds"].sum().sort_index()
    xs, ys = np.log(per_size.index.to_numpy(float)), np.log(np.maximum(per_size.to_numpy(float), 1e-12))
    x = math.log(max(message_bytes, 1.0))
    if len(xs) == 1:
        return float(per_size.iloc[0] * message_bytes / per_size.index[0])
    if x <= xs[0]:
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    elif x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    else:
        return float(math.exp(np.interp(x, xs, ys)))
    anchor = 0 if x <= xs[0] else -1
    return float(math.exp(ys[anchor] + slope * (x - xs[anchor])))


def kernel_seconds(table: Optional[pd.DataFrame], path: str, message_bytes: float, ops: Optional[tuple] = None, *,
                   group: str = WORLD) -> float:
    """Seconds of the collectives' own kernels (column `kernel_seconds`, module docstring) of `ops` on `path` over
    `group` for `message_bytes` float32 bytes: linear in the bytes between the table's sizes and beyond them along
    the nearest two; 0 where the table gives none."""
    table = of_group(table, group)
    if table is None or not len(table) or "kernel_seconds" not in table.columns:
        return 0.0
    rows = table[table["path"] == path]
    if ops is not None and "op" in rows.columns:
        rows = rows[rows["op"].isin(ops)]
    per_size = rows.groupby("message_bytes")["kernel_seconds"].sum().sort_index()
    if not len(per_size) or not (per_size.to_numpy(float) > 0).any():
        return 0.0
    xs, ys = per_size.index.to_numpy(float), per_size.to_numpy(float)
    if len(xs) == 1:
        return float(ys[0] * message_bytes / xs[0])
    i = 0 if message_bytes <= xs[0] else len(xs) - 2 if message_bytes >= xs[-1] else None
    if i is None:
        return float(np.interp(message_bytes, xs, ys))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(max(0.0, ys[i] + slope * (message_bytes - xs[i])))


__all__ = ["collective_seconds", "kernel_seconds", "has_collective", "of_group", "WORLD"]
