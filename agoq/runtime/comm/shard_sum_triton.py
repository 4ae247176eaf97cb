"""Triton kernel for the 8-bit all-reduce's middle step: the float32 sum of W dequantized shards.

`quantized_allreduce.sum_shards_reference` is its torch twin (same order of additions: rank 0 first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048


@triton.jit
def _sum_shards(codes_ptr, scales_ptr, out_ptr, world, length, code_row, scale_row, ZERO: tl.constexpr,
                BLOCK: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = offs < length
    acc = tl.zeros((TILE,), dtype=tl.float32)
    for w in range(0, world):
        c = tl.load(codes_ptr + w * code_row + offs, mask=inside, other=ZERO).to(tl.float32)
        s = tl.load(scales_ptr + w * scale_row + offs // BLOCK, mask=inside, other=0.0)
        acc += (c - ZERO) * s
    tl.store(out_ptr + offs, acc, mask=inside)


def sum_shards_triton(codes: torch.Tensor, scales: torch.Tensor, block: int, zero_code: int) -> torch.Tensor:
    """float32 [blocks * block] sum over W of (codes - zero) * scale; codes [W, L] uint8, scales [W, L / block].

    Rows may be strided views (unit stride within a row), as when codes and scales share a buffer.
    """
    if codes.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("sum_shards_triton needs rows with unit stride")
    world, length = codes.shape
    out = torch.empty(length, dtype=torch.float32, device=codes.device)
    if length:
        _sum_shards[(triton.cdiv(length, TILE),)](codes, scales, out, world, length, codes.stride(0), scales.stride(0),
                                                  ZERO=zero_code, BLOCK=block, TILE=TILE, num_warps=8)
    return out
