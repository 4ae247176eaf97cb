"""RoPE frequency scaling: the ``rope_type`` variants of HuggingFace ``config.json`` files.

Every variant here changes only the inverse frequencies of plain RoPE and, for some, multiplies the
cos/sin tables by a constant ("attention factor"); the rotation itself is unchanged. Formulas follow the
papers and the definitions HuggingFace transformers uses, so checkpoints behave the same in both:

* ``linear`` (position interpolation, Chen et al. 2023): every frequency divided by ``factor``.
* ``dynamic`` (dynamic NTK): for a sequence of length ``L`` longer than ``max_position_embeddings`` (M),
  the base becomes ``theta * (factor * L / M - (factor - 1)) ** (D / (D - 2))``; up to M it is plain RoPE.
  ``L`` is the largest position of the call plus one. transformers additionally keeps the frequencies of the
  longest sequence a model instance has seen so far (a cache: a later, shorter call longer than M reuses
  them); this model is stateless, so it equals transformers on every call whose sequence is at least as long
  as the earlier ones, in particular all calls of a training run at one sequence length.
* ``llama3`` (Llama 3.1 and later): wavelengths shorter than ``original / high_freq_factor`` are kept,
  longer than ``original / low_freq_factor`` divided by ``factor``, and the band between is blended linearly
  in ``original / wavelength``.
* ``yarn`` (Peng et al. 2023): per-frequency blend between the original and the ``factor``-interpolated
  frequency, by a linear ramp over the dimensions whose number of rotations within the original context lies
  between ``beta_slow`` and ``beta_fast``; cos/sin scaled by ``0.1 * ln(factor) + 1`` (or the mscale ratio).
* ``longrope`` (Ding et al. 2024, Phi-3): frequency ``i`` divided by ``short_factor[i]``, or by
  ``long_factor[i]`` when the sequence is longer than ``original_max_position_embeddings``; cos/sin scaled by
  ``sqrt(1 + ln(factor) / ln(original))``.

A scaling is kept as a normalised dict (``rope_type`` plus that type's parameters, never ``rope_theta``),
which is what ``LlamaConfig.rope_scaling`` holds and ``to_dict`` writes; agoq.models.rope_scaling checks and
normalises it and gives the cos/sin factor (it imports no torch), this module computes the frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _plain_inv_freq(head_dim: int, theta, device) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponent)


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int,
                    seq_len: torch.Tensor | int | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Float32 [D/2] inverse frequencies of RoPE with ``scaling`` (a normalised dict, or None for plain RoPE).

    ``seq_len`` (a 0-d integer tensor or an int: largest position + 1) matters only to ``dynamic`` and
    ``longrope``; None means a sequence no longer than ``max_position_embeddings`` (resp. the original length).
    A tensor is used as is, so neither a host sync nor the meta device is a problem.
    """
    if not scaling:
        return _plain_inv_freq(head_dim, theta, device)
    kind = scaling["rope_type"]
    half = head_dim // 2
    if kind == "linear":
        return _plain_inv_freq(head_dim, theta, device) / scaling["factor"]
    if kind == "dynamic":
        if seq_len is None:
            return _plain_inv_freq(head_dim, theta, device)
        factor, m = scaling["factor"], max_position_embeddings
        length = torch.as_tensor(seq_len, device=device).clamp(min=m).float()
        # the stretched base; at length == M the bracket is exactly 1, i.e. plain RoPE
        base = theta * (factor * length / m - (factor - 1.0)) ** (head_dim / (head_dim - 2))
        return _plain_inv_freq(head_dim, base, device)
    if kind == "llama3":
        inv = _plain_inv_freq(head_dim, theta, device)
        orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv
        long_wave = wavelength > orig / lo  # low frequencies: fully interpolated
        short_wave = wavelength < orig / hi  # high frequencies: untouched
        # in between: weight t of the original frequency grows linearly with orig / wavelength
        t = (orig / wavelength - lo) / (hi - lo)
        blended = (1 - t) * inv / factor + t * inv
        return torch.where(long_wave, inv / factor, torch.where(short_wave, inv, blended))
    if kind == "yarn":
        orig = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_position_embeddings / orig
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def dim_of(rotations: float) -> float:
            # the (fractional) pair index whose wavelength fits `rotations` times into the original context
            return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(fast), dim_of(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(half, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate by factor (slow dims)
        powers = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        return (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep
    if kind == "longrope":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device=device)
        inv_short = 1.0 / (short * theta ** exponent)
        if seq_len is None:
            return inv_short
        long = torch.tensor(scaling["long_factor"], dtype=torch.float32, device=device)
        inv_long = 1.0 / (long * theta ** exponent)
        is_long = torch.as_tensor(seq_len, device=device) > scaling["original_max_position_embeddings"]
        return torch.where(is_long, inv_long, inv_short)
    raise NotImplementedError(f"rope_type {kind!r}")  # normalize_rope_scaling refuses it first


__all__ = ["scaled_inv_freq"]
