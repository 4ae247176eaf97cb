"""Plain torch block quantization: the CPU path and the oracle the Triton kernels are tested against.

Every step is written so that the Triton kernels can reproduce it bit for bit in float32: the scale
is absmax / qmax, values are multiplied by 1/scale, nearest rounding is floor(v + 0.5), stochastic
rounding is floor(v + u) with u uniform in [0, 1). A block holding inf or NaN gets a NaN scale, so
every value of that block dequantizes to NaN: bad inputs become visible, never finite garbage.
"""

from __future__ import annotations

import torch

from agoq.runtime.quant.codebook import nf4_levels, nf4_thresholds
from agoq.runtime.quant.layout import int_qmax, num_blocks, packed_nbytes

TINY_SCALE = 2.0**-100  # below this a block's values are multiplied by LIFT before scaling
LIFT = 2.0**32


def block_scales(xb: torch.Tensor, bits: int, fmt: str) -> torch.Tensor:
    """Per-block float32 scales of `xb` [blocks, block] (absmax/qmax, or absmax for nf4); NaN if non-finite."""
    poison = (xb * 0.0).sum(dim=1)  # 0 for finite blocks, NaN as soon as one value is inf or NaN
    absmax = xb.abs().amax(dim=1) + poison
    if fmt == "nf4":
        return absmax
    return absmax / float(int_qmax(bits))


def encode(xb: torch.Tensor, scales: torch.Tensor, bits: int, fmt: str, noise: torch.Tensor | None) -> torch.Tensor:
    """Codes (int64, in [0, 2**bits)) of `xb` [blocks, block] given its scales; `noise` in [0,1) means stochastic."""
    # 1/scale overflows for subnormal scales: lift such blocks by an exact power of two first
    lift = torch.where(scales < TINY_SCALE, LIFT, 1.0)
    inv = torch.where(scales > 0, 1.0 / (scales * lift), torch.zeros_like(scales))
    v = (xb * lift[:, None]) * inv[:, None]
    v = torch.nan_to_num(v, nan=0.0)  # poisoned blocks: the NaN scale carries the error, codes stay valid
    if fmt == "nf4":
        if noise is None:
            thr = nf4_thresholds(xb.device)
            return (v[..., None] > thr).sum(dim=-1)
        levels = nf4_levels(xb.device)
        low = (v[..., None] >= levels[1:]).sum(dim=-1).clamp(max=14)
        lo, hi = levels[low], levels[low + 1]
        frac = (v - lo) / (hi - lo)
        return low + (noise < frac).to(low.dtype)
    qmax = int_qmax(bits)
    shift = 0.5 if noise is None else noise
    q = torch.floor(v + shift).clamp(-qmax, qmax)
    return (q + qmax).to(torch.int64)


def pack(codes: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Pack the first `numel` codes (int64, flat) LSB-first into ceil(numel*bits/8) uint8 bytes."""
    groups = (numel + 7) // 8
    c = torch.zeros(groups * 8, dtype=torch.int64, device=codes.device)
    c[:numel] = codes[:numel]
    shifts = torch.arange(8, device=codes.device) * bits
    words = (c.view(groups, 8) << shifts).sum(dim=1)  # disjoint bit fields: sum == or
    byte_shifts = torch.arange(bits, device=codes.device) * 8
    out = ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(numel, bits)].contiguous()


def unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack`: the first `numel` codes (int64) from densely packed bytes."""
    groups = (numel + 7) // 8
    padded = torch.zeros(groups * bits, dtype=torch.int64, device=data.device)
    padded[: data.numel()] = data.to(torch.int64)
    byte_shifts = torch.arange(bits, device=data.device) * 8
    words = (padded.view(groups, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=data.device) * bits
    codes = (words[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel]


def quantize_reference(
    flat: torch.Tensor, bits: int, block: int, fmt: str = "int", noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat float tensor: (packed uint8 codes, float32 scales per block).

    `noise`, if given, holds one uniform [0, 1) number per value and selects stochastic rounding.
    """
    n = flat.numel()
    nb = num_blocks(n, block)
    xb = torch.zeros(nb * block, dtype=torch.float32, device=flat.device)
    xb[:n] = flat.float()
    xb = xb.view(nb, block)
    scales = block_scales(xb, bits, fmt)
    nz = None
    if noise is not None:
        nz = torch.zeros(nb * block, dtype=torch.float32, device=flat.device)
        nz[:n] = noise
        nz = nz.view(nb, block)
    codes = encode(xb, scales, bits, fmt, nz).reshape(-1)
    return pack(codes, bits, n), scales


def dequantize_reference(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, fmt: str, dtype: torch.dtype
) -> torch.Tensor:
    """Restore `numel` values (flat, in `dtype`) from packed codes and per-block scales."""
    codes = unpack(data, bits, numel)
    if fmt == "nf4":
        values = nf4_levels(data.device)[codes]
    else:
        values = (codes - int_qmax(bits)).to(torch.float32)
    idx = torch.arange(numel, device=data.device) // block
    return (values * scales[idx]).to(dtype)
