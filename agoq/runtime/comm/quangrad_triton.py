"""Triton kernel for QuanGrad's gradient accumulation: 8-bit codes += gradient, in one pass.

Per block: dequantize the stored codes, add the new gradient in float32, take the new absmax and
requantize, writing codes and scale back in place. `quangrad.accumulate_reference` is its torch twin;
the arithmetic is the same operation for operation (agoq/runtime/quant/quantize_kernel.py explains the
rounding), so the stored bytes match it exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.runtime.quant.reference import LIFT, TINY_SCALE
from agoq.runtime.quant.triton_common import INT8_QMAX, USE_ASM, mul_rn, requantize_int8

BLOCKS_PER_PROGRAM = 8


@triton.jit
def _accumulate_kernel(codes_ptr, scales_ptr, grad_ptr, n, nblocks,
                       BLOCK: tl.constexpr, BPP: tl.constexpr, TINY: tl.constexpr, LIFT_F: tl.constexpr,
                       USE_ASM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid * BPP + tl.arange(0, BPP)[:, None]  # [BPP, 1] block index
    off = b * BLOCK + tl.arange(0, BLOCK)[None, :]  # [BPP, BLOCK] value index
    live = b < nblocks
    code = tl.load(codes_ptr + off, mask=live, other=INT8_QMAX).to(tl.int32)
    scale = tl.load(scales_ptr + b, mask=live, other=0.0)
    g = tl.load(grad_ptr + off, mask=off < n, other=0.0).to(tl.float32)
    v = mul_rn((code - INT8_QMAX).to(tl.float32), scale, USE_ASM) + g  # two roundings, as the reference: no FMA

    codes, s = requantize_int8(v, TINY, LIFT_F, USE_ASM)  # NaN scale as soon as one value is NaN or inf
    tl.store(codes_ptr + off, codes, mask=live)
    tl.store(scales_ptr + b, s, mask=live)


def accumulate_triton(codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, block: int) -> None:
    """codes [blocks * block] uint8 and scales [blocks] float32 += grad (its first grad.numel() values), in place."""
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("accumulate_triton needs contiguous codes and scales")
    if block & (block - 1):
        raise ValueError(f"accumulate_triton needs a power-of-two block, got {block}")
    flat = grad.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    nblocks = scales.numel()
    if nblocks == 0:
        return
    grid = (triton.cdiv(nblocks, BLOCKS_PER_PROGRAM),)
    _accumulate_kernel[grid](codes, scales, flat, flat.numel(), nblocks, BLOCK=block, BPP=BLOCKS_PER_PROGRAM,
                             TINY=TINY_SCALE, LIFT_F=LIFT, USE_ASM=USE_ASM, num_warps=4)
