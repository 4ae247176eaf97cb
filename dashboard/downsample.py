"""Thinning long series for plotting without losing their spikes: per bucket of consecutive points,
keep the lowest and the highest one (plus the first and last point of the series)."""

from __future__ import annotations

import numpy as np


def minmax_indices(y: np.ndarray, max_points: int) -> np.ndarray:
    """Sorted indices into `y` of at most `max_points` points (>= 4): the first and last point, and in
    each of (max_points - 2) // 2 equal buckets of consecutive points the position of its minimum and
    of its maximum (NaNs ignored; a bucket of NaNs keeps its first point, so gaps stay visible).
    With no more than `max_points` points, every index is returned."""
    n = len(y)
    if max_points < 4:
        raise ValueError(f"max_points must be >= 4, got {max_points}")
    if n <= max_points:
        return np.arange(n)
    y = np.asarray(y, dtype=np.float64)
    buckets = (max_points - 2) // 2
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    keep = [0, n - 1]
    for lo, hi in zip(edges[:-1], edges[1:]):
        part = y[lo:hi]
        if hi <= lo:
            continue
        finite = np.isfinite(part)
        if not finite.any():
            keep.append(lo)
            continue
        masked_low = np.where(finite, part, np.inf)
        masked_high = np.where(finite, part, -np.inf)
        keep.append(lo + int(np.argmin(masked_low)))
        keep.append(lo + int(np.argmax(masked_high)))
    return np.unique(np.asarray(keep, dtype=np.int64))
