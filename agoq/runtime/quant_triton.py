"""Triton kernels for block quantization; `quant_reference` is their plain torch twin.

One program handles BLOCKS_PER_PROG consecutive blocks (a tile). The tile is read once, block absmax
and scales are computed in registers, codes are packed and written once: the kernels move the
fewest bytes possible and run at close to copy bandwidth. Bit widths that divide 8 pack whole codes
into each byte; 3, 5, 6 and 7 bits pack 8 codes into a 64-bit word and write its low `bits` bytes.

Set TRITON_INTERPRET=1 before importing this module to run the kernels on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.runtime.codebook import nf4_levels, nf4_thresholds
from agoq.runtime.qtensor import int_qmax, num_blocks, packed_nbytes
from agoq.runtime.quant_reference import LIFT, TINY_SCALE

TILE_VALUES = 2048  # values per program, when the block is smaller
NUM_WARPS = 4


@triton.jit
def _quantize_kernel(
    x_ptr, data_ptr, scale_ptr, levels_ptr, thr_ptr, n, nbytes, nblocks, seed,
    BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr,
    NF4: tl.constexpr, STOCHASTIC: tl.constexpr, TINY: tl.constexpr, LIFT_F: tl.constexpr,
):
    TILE: tl.constexpr = BLOCK * BPP
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * TILE + tl.arange(0, TILE)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    xb = tl.reshape(x, (BPP, BLOCK))
    poison = tl.sum(xb * 0.0, axis=1)  # NaN when the block holds inf or NaN
    absmax = tl.max(tl.abs(xb), axis=1) + poison
    if NF4:
        scale = absmax
    else:
        scale = tl.math.div_rn(absmax, QMAX * 1.0)
    bidx = pid * BPP + tl.arange(0, BPP)
    tl.store(scale_ptr + bidx, scale, mask=bidx < nblocks)

    lift = tl.where(scale < TINY, LIFT_F, 1.0)
    inv = tl.where(scale > 0, tl.math.div_rn(1.0, tl.where(scale > 0, scale * lift, 1.0)), 0.0)
    v = (xb * lift[:, None]) * inv[:, None]
    v = tl.reshape(v, (TILE,))
    v = tl.where(v == v, v, 0.0)
    if STOCHASTIC:
        u = tl.rand(seed, offs.to(tl.int32))
    if NF4:
        k16 = tl.arange(0, 16)
        if STOCHASTIC:
            lv = tl.load(levels_ptr + 1 + k16, mask=k16 < 15, other=float("inf"))
            low = tl.sum((v[:, None] >= lv[None, :]).to(tl.int32), axis=1)
            low = tl.minimum(low, 14)
            lo = tl.load(levels_ptr + low)
            hi = tl.load(levels_ptr + low + 1)
            frac = tl.math.div_rn(v - lo, hi - lo)
            code = low + (u < frac).to(tl.int32)
        else:
            th = tl.load(thr_ptr + k16, mask=k16 < 15, other=float("inf"))
            code = tl.sum((v[:, None] > th[None, :]).to(tl.int32), axis=1)
    else:
        if STOCHASTIC:
            q = tl.floor(v + u)
        else:
            q = tl.floor(v + 0.5)
        q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
        code = q.to(tl.int32) + QMAX
    code = tl.where(inside, code, 0)

    if 8 % BITS == 0:
        VPB: tl.constexpr = 8 // BITS
        if VPB == 1:
            packed = code
        else:
            c = tl.reshape(code, (TILE // VPB, VPB))
            sh = tl.arange(0, VPB) * BITS
            packed = tl.sum(c << sh[None, :], axis=1)
        boffs = pid * (TILE // VPB) + tl.arange(0, TILE // VPB)
        tl.store(data_ptr + boffs, packed.to(tl.uint8), mask=boffs < nbytes)
    else:
        c = tl.reshape(code, (TILE // 8, 8)).to(tl.int64)
        k = tl.arange(0, 8)
        word = tl.sum(c << (k * BITS)[None, :], axis=1)
        byte = (word[:, None] >> (k * 8)[None, :]) & 255
        g = pid * (TILE // 8) + tl.arange(0, TILE // 8)
        addr = g[:, None] * BITS + k[None, :]
        tl.store(data_ptr + addr, byte.to(tl.uint8), mask=(k[None, :] < BITS) & (addr < nbytes))


@triton.jit
def _dequantize_kernel(
    data_ptr, scale_ptr, levels_ptr, out_ptr, n, nbytes, nblocks,
    BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, NF4: tl.constexpr,
):
    TILE: tl.constexpr = BLOCK * BPP
    MASK: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0).to(tl.int64)
    if 8 % BITS == 0:
        VPB: tl.constexpr = 8 // BITS
        boffs = pid * (TILE // VPB) + tl.arange(0, TILE // VPB)
        packed = tl.load(data_ptr + boffs, mask=boffs < nbytes, other=0).to(tl.int32)
        if VPB == 1:
            codes = packed
        else:
            sh = tl.arange(0, VPB) * BITS
            codes = tl.reshape((packed[:, None] >> sh[None, :]) & MASK, (TILE,))
    else:
        k = tl.arange(0, 8)
        g = pid * (TILE // 8) + tl.arange(0, TILE // 8)
        addr = g[:, None] * BITS + k[None, :]
        byte = tl.load(data_ptr + addr, mask=(k[None, :] < BITS) & (addr < nbytes), other=0).to(tl.int64)
        word = tl.sum(byte << (k * 8)[None, :], axis=1)
        codes = tl.reshape(((word[:, None] >> (k * BITS)[None, :]) & MASK).to(tl.int32), (TILE,))
    if NF4:
        vals = tl.load(levels_ptr + codes)
    else:
        vals = (codes - QMAX).to(tl.float32)
    bidx = pid * BPP + tl.arange(0, BPP)
    scale = tl.load(scale_ptr + bidx, mask=bidx < nblocks, other=0.0)
    out = tl.reshape(tl.reshape(vals, (BPP, BLOCK)) * scale[:, None], (TILE,))
    offs = pid * TILE + tl.arange(0, TILE)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=offs < n)


def _blocks_per_program(block: int) -> int:
    return max(1, TILE_VALUES // block)


def quantize_triton(
    flat: torch.Tensor, bits: int, block: int, fmt: str = "int", seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous flat tensor: (packed uint8 codes, float32 scales); `seed` selects stochastic rounding."""
    n = flat.numel()
    nb, nbytes = num_blocks(n, block), packed_nbytes(n, bits)
    data = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    scales = torch.empty(nb, dtype=torch.float32, device=flat.device)
    if n == 0:
        return data, scales
    bpp = _blocks_per_program(block)
    grid = (triton.cdiv(n, block * bpp),)
    _quantize_kernel[grid](
        flat, data, scales, nf4_levels(flat.device), nf4_thresholds(flat.device), n, nbytes, nb,
        0 if seed is None else seed,
        BITS=bits, QMAX=int_qmax(bits), BLOCK=block, BPP=bpp, NF4=fmt == "nf4",
        STOCHASTIC=seed is not None, TINY=TINY_SCALE, LIFT_F=LIFT, num_warps=NUM_WARPS,
    )
    return data, scales


def dequantize_triton(
    data: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, fmt: str, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Restore `numel` values (flat, `dtype`) from packed codes and scales, into `out` if given."""
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=data.device)
    if numel == 0:
        return out
    bpp = _blocks_per_program(block)
    grid = (triton.cdiv(numel, block * bpp),)
    _dequantize_kernel[grid](
        data, scales, nf4_levels(data.device), out, numel, data.numel(), scales.numel(),
        BITS=bits, QMAX=int_qmax(bits), BLOCK=block, BPP=bpp, NF4=fmt == "nf4", num_warps=NUM_WARPS,
    )
    return out
