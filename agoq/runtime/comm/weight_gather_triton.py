"""Fused Triton kernels of FSDP2's quantized weight all-gather (the wire format of `weight_gather_codec`, whose
torch reference they match: the same float32 operations, one rounding each, so the bytes agree except where the
Hadamard product sums in another order).

- `quantize_shard_triton`: one pass over this rank's shard -> its uint8 all-gather input. The zero padding of
  FSDP2's padded shard and of the last block is a masked load, never a tensor; int4's Hadamard-32 product is an
  IEEE float32 `tl.dot` on the [values / 32, 32] tile in registers.
- `dequantize_gather_triton`: one pass over the gathered bytes, writing (c - qmax) * s (times H for int4) in the
  parameter dtype straight into FSDP2's unsharded parameter, rank r's value j at r * numel + j; padding rows and
  block padding are masked stores, never a full-size temporary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.runtime.comm.weight_gather_codec import GROUP, WireLayout, hadamard_on
from agoq.runtime.quant.triton_common import nanmax

BLOCKS_PER_PROGRAM = 4  # quantize: blocks per program, at least DOT_ROWS * 32 values (tl.dot's M >= 16)
DOT_ROWS = 16
TILE = 2048  # dequantize: values per program (a multiple of 32 and of 2)


@triton.jit
def _quantize_shard(x_ptr, codes_ptr, scales_ptr, h_ptr, n, nblocks, BITS: tl.constexpr, BLOCK: tl.constexpr,
                    BPP: tl.constexpr, HADAMARD: tl.constexpr, QMAX: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid * BPP + tl.arange(0, BPP)[:, None]  # [BPP, 1] block index
    off = b * BLOCK + tl.arange(0, BLOCK)[None, :]  # [BPP, BLOCK] value index in the padded shard
    live = b < nblocks
    x = tl.load(x_ptr + off, mask=off < n, other=0.0).to(tl.float32)  # zeros past the shard: FSDP2's padding
    if HADAMARD:
        c = tl.arange(0, GROUP)
        h = tl.load(h_ptr + c[:, None] * GROUP + c[None, :])
        g = tl.dot(tl.reshape(x, (BPP * BLOCK // GROUP, GROUP)), h, input_precision="ieee")
        x = tl.reshape(g, (BPP, BLOCK))
    absmax = tl.reduce(tl.abs(x), 1, nanmax, keep_dims=True)  # [BPP, 1]
    s = tl.math.div_rn(absmax, QMAX * 1.0)
    v = tl.math.div_rn(x, tl.where(s > 0, s, 1.0))
    v = tl.where(v == v, v, 0.0)
    q = tl.minimum(tl.maximum(tl.floor(v + 0.5), -QMAX * 1.0), QMAX * 1.0) + QMAX
    q = q.to(tl.int32)
    if BITS == 8:
        tl.store(codes_ptr + off, q.to(tl.uint8), mask=live)
    else:
        lo, hi = tl.split(tl.reshape(q, (BPP, BLOCK // 2, 2)))
        boff = b * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(codes_ptr + boff, (lo | (hi << 4)).to(tl.uint8), mask=live)
    tl.store(scales_ptr + b, s, mask=live)


@triton.jit
def _dequantize_gather(bytes_ptr, words_ptr, out_ptr, h_ptr, numel, padded, total, row_bytes, scale_word0,
                       BITS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, HADAMARD: tl.constexpr,
                       QMAX: tl.constexpr, GROUP: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)  # rank (grid axis 1: at most 65535)
    j = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)  # value index in the rank's padded shard
    inside = j < padded
    if BITS == 8:
        code = tl.load(bytes_ptr + r * row_bytes + j, mask=inside, other=QMAX).to(tl.int32)
    else:
        byte = tl.load(bytes_ptr + r * row_bytes + j // 2, mask=inside, other=QMAX * 17).to(tl.int32)
        code = (byte >> ((j & 1) * 4).to(tl.int32)) & 15
    s = tl.load(words_ptr + r * (row_bytes // 4) + scale_word0 + j // BLOCK, mask=inside, other=0.0)
    v = (code - QMAX).to(tl.float32) * s
    if HADAMARD:
        c = tl.arange(0, GROUP)
        h = tl.load(h_ptr + c[:, None] * GROUP + c[None, :])
        v = tl.reshape(tl.dot(tl.reshape(v, (TILE // GROUP, GROUP)), h, input_precision="ieee"), (TILE,))
    dest = r * numel + j
    tl.store(out_ptr + dest, v.to(out_ptr.dtype.element_ty), mask=(j < numel) & (dest < total))


def quantize_shard_triton(local: torch.Tensor, lay: WireLayout) -> torch.Tensor:
    """`weight_gather_codec.quantize_shard_reference` in one kernel: a new uint8 tensor of lay.nbytes."""
    flat = local.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.empty(lay.nbytes, dtype=torch.uint8, device=local.device)
    if flat.numel() == 0:  # a rank with no rows: keep a valid pointer (every load is masked)
        flat = out[:0].new_zeros(1, dtype=torch.float32)
    scales = out[lay.code_bytes:].view(torch.float32)
    bpp = max(BLOCKS_PER_PROGRAM, DOT_ROWS * GROUP // lay.block)
    grid = (triton.cdiv(lay.nblocks, bpp),)
    _quantize_shard[grid](flat, out, scales, hadamard_on(local.device), local.numel(), lay.nblocks, BITS=lay.bits,
                          BLOCK=lay.block, BPP=bpp, HADAMARD=lay.hadamard, QMAX=lay.qmax, GROUP=GROUP, num_warps=4)
    return out


def dequantize_gather_triton(gathered: torch.Tensor, lay: WireLayout, world: int, out: torch.Tensor) -> None:
    """`weight_gather_codec.dequantize_gather_reference` in one kernel, written into `out` (contiguous)."""
    if not (gathered.is_contiguous() and out.is_contiguous()):
        raise ValueError("dequantize_gather_triton needs contiguous gathered bytes and a contiguous output")
    if gathered.numel() != world * lay.nbytes or out.numel() != lay.total:
        raise ValueError(f"dequantize_gather_triton: {gathered.numel()} gathered bytes and {out.numel()} output "
                         f"values, expected {world * lay.nbytes} and {lay.total}")
    if lay.total == 0:
        return
    flat = gathered.reshape(-1)
    words = flat.view(torch.float32)
    grid = (triton.cdiv(lay.numel, TILE), world)
    _dequantize_gather[grid](flat, words, out.view(-1), hadamard_on(gathered.device), lay.numel, lay.padded,
                             lay.total, lay.nbytes, lay.code_bytes // 4, BITS=lay.bits, BLOCK=lay.block, TILE=TILE,
                             HADAMARD=lay.hadamard, QMAX=lay.qmax, GROUP=GROUP, num_warps=8)
