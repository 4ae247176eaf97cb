"""Launching the block-quantization Triton kernels (`quantize_kernel`, `dequantize_kernel`; `reference` is
their plain torch twin, bit for bit): `quantize_triton` / `dequantize_triton` run them eagerly (into given
buffers if asked), `quantize_op_body` / `dequantize_op_body` are the CUDA bodies of the torch operators
(agoq.runtime.quant.operators). Here are the launch settings (values per program, warps, the Philox rounds of
stochastic rounding) and the host-side tables the quantize kernel reads (nf4 lookup cells, the packing
constant), each computed once.

Set TRITON_INTERPRET=1 before importing this module to run the kernels on CPU tensors.
"""

from __future__ import annotations

import functools

import torch
import triton

from agoq.runtime.quant.codebook import nf4_levels, nf4_thresholds
from agoq.runtime.quant.dequantize_kernel import dequantize_kernel
from agoq.runtime.quant.layout import int_qmax, num_blocks, packed_nbytes
from agoq.runtime.quant.quantize_kernel import quantize_kernel
from agoq.runtime.quant.reference import LIFT, TINY_SCALE
from agoq.runtime.quant.triton_common import USE_ASM
from agoq.triton_ops import register_kernels, wrap

TILE_VALUES = 2048  # values per program, when the block is smaller
NUM_WARPS = 4  # dequantize; quantize uses min(NUM_WARPS, tile / 1024): 32 values per thread
PHILOX_ROUNDS = 7  # stochastic rounding: Philox rounds per 128 random bits (8 values); Triton's default is 10
ODD_GATHER_BITS = ()  # odd widths whose words go through shared memory (coalesced stores); else direct
NF4_CELLS = 16  # nf4 lookup cells per unit of v, a power of two (1/16 < the smallest threshold gap)

_MAGIC = 12582912.0  # 1.5 * 2**23: x + MAGIC (for |x| < 2**22) holds an integer in its low mantissa bits
_MAGIC_BITS = 0x4B400000
_LUT_SIZE = 128


def _blocks_per_program(block: int) -> int:
    return max(1, TILE_VALUES // block)


def _quantize_warps(tile: int) -> int:
    """The quantize kernel gives each thread 32 values: no more warps than the tile fills."""
    return max(1, min(NUM_WARPS, tile // 1024))


def _pack_constant(bits: int) -> int:
    """For 2 and 4 bits: minus the sum over a run of (MAGIC bits << position), mod 2**32."""
    if bits not in (2, 4):
        return 0
    return -sum(_MAGIC_BITS << (e * bits) for e in range(8)) % 2**32


@functools.lru_cache(maxsize=None)
def _nf4_lut_cpu(cells_per_unit: int) -> torch.Tensor:
    """int64 table: [0:128) nearest cells, [128:256) stochastic cells, [256:272) level segments.

    Each entry packs a float32 (low 32 bits) and an int32 or float32 (high 32 bits). Cell i covers
    v in [(i - C - 1/2) / C, (i - C + 1/2) / C] (C = NF4_CELLS), both ends included since rint breaks
    ties either way; indices past the [-1, 1] range wrap to entries that saturate (never used: |v| <= 1
    up to rounding, and larger values are clamped first)."""
    thr = nf4_thresholds("cpu").to(torch.float32)
    lv = nf4_levels("cpu").to(torch.float32)
    inner = lv[1:15]  # the reference's `low` counts levels[1:] <= v, clamped to 14: levels[1..14]

    def cells(points: torch.Tensor, magic: bool) -> torch.Tensor:
        table = torch.zeros(_LUT_SIZE, dtype=torch.int64)
        p = points.double()
        for i in range(_LUT_SIZE):
            k = i - cells_per_unit if i - cells_per_unit < _LUT_SIZE // 2 else i - _LUT_SIZE - cells_per_unit
            lo, hi = (k - 0.5) / cells_per_unit, (k + 0.5) / cells_per_unit
            inside = ((p >= lo) & (p <= hi)).nonzero().flatten()
            if len(inside) > 1:
                raise AssertionError("nf4 lookup cells too coarse")
            below = int((p < lo).sum())
            point = float(points[inside[0]]) if len(inside) else float("inf")
            bits = torch.tensor([point], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
            if magic:  # the count as the float MAGIC + below
                below = torch.tensor([_MAGIC + below], dtype=torch.float32).view(torch.int32).item()
            table[i] = (below << 32) | bits
        return table

    seg = torch.zeros(16, dtype=torch.int64)
    for j in range(15):
        lo_bits = lv[j : j + 1].view(torch.int32).item() & 0xFFFFFFFF
        w_bits = (lv[j + 1 : j + 2] - lv[j : j + 1]).view(torch.int32).item() & 0xFFFFFFFF
        seg[j] = (w_bits << 32) | lo_bits
    # nearest: code = below + (v > thr); stochastic: low = below + (v >= level)
    return torch.cat([cells(thr, True), cells(inner, False), seg])


@functools.lru_cache(maxsize=None)
def _nf4_lut(device: torch.device, cells_per_unit: int = NF4_CELLS) -> torch.Tensor:
    """The nf4 lookup table on `device`, built and copied there once per device."""
    return _nf4_lut_cpu(cells_per_unit).to(device)


@functools.lru_cache(maxsize=None)
def _nf4_levels_on(device: torch.device) -> torch.Tensor:
    return nf4_levels(device)


@functools.lru_cache(maxsize=None)
def _quantize_meta(bits: int, block: int, fmt: str, stochastic: bool) -> tuple[int, dict]:
    """(values per program, the kernel's constexpr and launch options) of a setting, computed once."""
    tile = block * _blocks_per_program(block)
    return tile, dict(
        BITS=bits, QMAX=int_qmax(bits), BLOCK=block, BPP=tile // block, NF4=fmt == "nf4", STOCHASTIC=stochastic,
        TINY=TINY_SCALE, LIFT_F=LIFT, USE_ASM=USE_ASM, NF4_CELLS=NF4_CELLS, ROUNDS=PHILOX_ROUNDS,
        PACK_C=_pack_constant(bits), ODD_GATHER=bits in ODD_GATHER_BITS, num_warps=_quantize_warps(tile))


@functools.lru_cache(maxsize=None)
def _dequantize_meta(bits: int, block: int, fmt: str) -> tuple[int, dict]:
    tile = block * _blocks_per_program(block)
    return tile, dict(BITS=bits, QMAX=int_qmax(bits), BLOCK=block, BPP=tile // block, NF4=fmt == "nf4",
                      num_warps=NUM_WARPS)


def quantize_triton(
    flat: torch.Tensor, bits: int, block: int, fmt: str = "int", seed: int | None = None,
    data_out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous flat tensor: (packed uint8 codes, float32 scales); `seed` selects stochastic rounding.

    `data_out` / `scales_out` (contiguous, e.g. views into a wire buffer) receive the result instead of
    new tensors; they must hold at least the packed bytes and the blocks.
    """
    n = flat.numel()
    nb, nbytes = num_blocks(n, block), packed_nbytes(n, bits)
    data = torch.empty(nbytes, dtype=torch.uint8, device=flat.device) if data_out is None else data_out
    scales = torch.empty(nb, dtype=torch.float32, device=flat.device) if scales_out is None else scales_out
    if data.numel() < nbytes or scales.numel() < nb or not (data.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"quantize_triton: outputs must be contiguous and hold {nbytes} bytes and {nb} scales")
    if n == 0:
        return data, scales
    tile, meta = _quantize_meta(bits, block, fmt, seed is not None)
    lut = _nf4_lut(flat.device) if fmt == "nf4" else flat  # int: never read
    quantize_kernel[(triton.cdiv(n, tile),)](flat, data, scales, lut, n, nbytes, nb,
                                              0 if seed is None else seed, **meta)
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
    tile, meta = _dequantize_meta(bits, block, fmt)
    levels = _nf4_levels_on(data.device) if fmt == "nf4" else scales  # int: never read
    dequantize_kernel[(triton.cdiv(numel, tile),)](data, scales, levels, out, numel, data.numel(), scales.numel(),
                                                    **meta)
    return out


# The bodies of the operators agoq::quantize_block / agoq::dequantize_block (agoq.runtime.quant.operators): fresh outputs
# allocated with torch ops, the kernel launched through wrap_triton so that torch.compile traces the launch.
# Unused pointer arguments get an input tensor (never an output: two names for one mutated buffer would
# confuse the functionalization of the launch).


def quantize_op_body(flat: torch.Tensor, bits: int, block: int, fmt: str, seed: int | None):
    n = flat.numel()
    data = flat.new_empty(packed_nbytes(n, bits), dtype=torch.uint8)
    scales = flat.new_empty(num_blocks(n, block), dtype=torch.float32)
    if n:
        tile, meta = _quantize_meta(bits, block, fmt, seed is not None)
        lut = _nf4_lut(flat.device) if fmt == "nf4" else flat
        wrap(quantize_kernel)[(triton.cdiv(n, tile),)](flat, data, scales, lut, n, data.numel(), scales.numel(),
                                                        0 if seed is None else seed, **meta)
    return data, scales


def dequantize_op_body(data: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, fmt: str,
                       dtype: torch.dtype) -> torch.Tensor:
    out = data.new_empty(numel, dtype=dtype)
    if numel:
        tile, meta = _dequantize_meta(bits, block, fmt)
        levels = _nf4_levels_on(data.device) if fmt == "nf4" else scales
        wrap(dequantize_kernel)[(triton.cdiv(numel, tile),)](data, scales, levels, out, numel, data.numel(),
                                                              scales.numel(), **meta)
    return out


register_kernels("agoq::quantize_block", [quantize_kernel])
register_kernels("agoq::dequantize_block", [dequantize_kernel])
