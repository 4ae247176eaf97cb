"""The 4-bit normal-float codebook: 16 levels placed at quantiles of a standard normal.

Block-wise activations are close to normal once divided by their block's absmax, so levels spaced by
the normal's quantiles spend the 16 codes where the values are. The construction follows the
normal-float idea (Dettmers et al., QLoRA): 8 positive and 7 negative quantiles plus an exact zero,
normalised so that the extreme levels are -1 and +1.
"""

from __future__ import annotations

import functools

import torch

_TAIL = 0.9677083  # the outermost quantile used; keeps the extreme level finite


def _normal_quantiles(lo: float, hi: float, count: int) -> torch.Tensor:
    probs = torch.linspace(lo, hi, count, dtype=torch.float64)
    return torch.special.ndtri(probs)


@functools.lru_cache(maxsize=None)
def _nf4_levels_cpu() -> torch.Tensor:
    positive = _normal_quantiles(_TAIL, 0.5, 9)[:-1]  # 8 levels above zero
    negative = -_normal_quantiles(_TAIL, 0.5, 8)[:-1]  # 7 levels below zero
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    levels = levels / levels.abs().max()
    return levels.to(torch.float32)


@functools.lru_cache(maxsize=None)
def _on_device(name: str, device: str) -> torch.Tensor:
    levels = _nf4_levels_cpu()
    table = levels if name == "levels" else (levels[1:] + levels[:-1]) * 0.5
    return table.to(device)


def nf4_levels(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 sorted levels of the 4-bit normal-float codebook in [-1, 1], float32, on `device`."""
    return _on_device("levels", str(torch.device(device)))


def nf4_thresholds(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 midpoints between consecutive levels: a value's nearest code is how many it exceeds."""
    return _on_device("thresholds", str(torch.device(device)))
