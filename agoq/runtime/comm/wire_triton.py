"""Triton kernels of the 8-bit all-reduce, working on wire rows wherever they live.

A row (agoq/runtime/comm/wire_rows.py) is `per` blocks of int8 codes followed by their float32 scales.
Rows are named by address through a small int64 table, so one launch can write the rows of every
destination rank, including rows in other GPUs' symmetric memory (stores then travel over NVLink
while other blocks of the same launch work on local memory):

  quantize_to_rows      a flat tensor -> W rows (shard d into table[d])
  sum_requantize_rows   W local rows -> float32 sum -> one requantized row, stored at every table entry
  dequantize_rows       W local rows -> the flat tensor, each scale divided by `divisor` first

Their torch twins are in wire_rows.py; the arithmetic is the same operation for operation (products
rounded before sums, no FMA contraction), so the bytes match exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.runtime.quant.reference import LIFT, TINY_SCALE
from agoq.runtime.quant.triton_common import INT8_QMAX, USE_ASM, mul_rn, requantize_int8

BLOCKS_PER_PROGRAM = 8


@triton.jit
def _quantize_to_rows(x_ptr, table_ptr, n, per, world, j0, count,
                      BLOCK: tl.constexpr, BPP: tl.constexpr, TINY: tl.constexpr, LIFT_F: tl.constexpr,
                      USE_ASM: tl.constexpr):
    # consecutive programs go to different rows, so stores to peers (NVLink) and to local memory interleave
    pid = tl.program_id(0).to(tl.int64)
    d = pid % world
    jj = (pid // world) * BPP + tl.arange(0, BPP)[:, None]  # [BPP, 1] block within the chunk
    live = jj < count
    j = j0 + jj
    col = tl.arange(0, BLOCK)[None, :]
    off = (d * per + j) * BLOCK + col
    v = tl.load(x_ptr + off, mask=live & (off < n), other=0.0).to(tl.float32)
    codes, s = requantize_int8(v, TINY, LIFT_F, USE_ASM)
    row = tl.load(table_ptr + d).to(tl.pointer_type(tl.uint8))
    tl.store(row + j * BLOCK + col, codes, mask=live)
    tl.store((row + per * BLOCK).to(tl.pointer_type(tl.float32)) + j, s, mask=live)


@triton.jit
def _sum_requantize_rows(rows_ptr, row_bytes, world, table_ptr, ndest, per, j0, count,
                         BLOCK: tl.constexpr, BPP: tl.constexpr, TINY: tl.constexpr, LIFT_F: tl.constexpr,
                         USE_ASM: tl.constexpr):
    jj = tl.program_id(0).to(tl.int64) * BPP + tl.arange(0, BPP)[:, None]  # [BPP, 1] block within the chunk
    live = jj < count
    j = j0 + jj
    col = tl.arange(0, BLOCK)[None, :]
    acc = tl.zeros((BPP, BLOCK), dtype=tl.float32)
    for w in range(0, world):
        base = rows_ptr + w * row_bytes
        c = tl.load(base + j * BLOCK + col, mask=live, other=127).to(tl.int32)
        s = tl.load((base + per * BLOCK).to(tl.pointer_type(tl.float32)) + j, mask=live, other=0.0)
        acc += mul_rn((c - INT8_QMAX).to(tl.float32), s, USE_ASM)
    codes, scale = requantize_int8(acc, TINY, LIFT_F, USE_ASM)
    for k in range(0, ndest):
        row = tl.load(table_ptr + k).to(tl.pointer_type(tl.uint8))
        tl.store(row + j * BLOCK + col, codes, mask=live)
        tl.store((row + per * BLOCK).to(tl.pointer_type(tl.float32)) + j, scale, mask=live)


@triton.jit
def _dequantize_rows(rows_ptr, row_bytes, out_ptr, n, per, world, j0, count, divisor,
                     BLOCK: tl.constexpr, BPP: tl.constexpr, DIVIDE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    d = pid % world
    jj = (pid // world) * BPP + tl.arange(0, BPP)[:, None]
    live = jj < count
    j = j0 + jj
    col = tl.arange(0, BLOCK)[None, :]
    base = rows_ptr + d * row_bytes
    c = tl.load(base + j * BLOCK + col, mask=live, other=127).to(tl.int32)
    s = tl.load((base + per * BLOCK).to(tl.pointer_type(tl.float32)) + j, mask=live, other=0.0)
    if DIVIDE:
        s = tl.math.div_rn(s, divisor * 1.0)
    off = (d * per + j) * BLOCK + col
    tl.store(out_ptr + off, ((c - INT8_QMAX).to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=live & (off < n))


def _grid(programs: int) -> tuple[int]:
    return (max(1, programs),)


def row_table(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 addresses of `rows` (each a contiguous uint8 row, anywhere this GPU can reach), on `device`."""
    return torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=device)


def _chunk(per: int, chunk: tuple[int, int] | None) -> tuple[int, int]:
    return (0, per) if chunk is None else chunk


def quantize_to_rows_triton(flat: torch.Tensor, table: torch.Tensor, per: int, block: int,
                            chunk: tuple[int, int] | None = None) -> None:
    """Quantize flat float `flat` to 8 bits; blocks [d*per, (d+1)*per) go to the row at table[d]
    (values past flat.numel() become code 0 with scale 0). `chunk` = (first, count) limits the work to
    those blocks of every row."""
    j0, count = _chunk(per, chunk)
    world = table.numel()
    _quantize_to_rows[_grid(world * triton.cdiv(count, BLOCKS_PER_PROGRAM))](
        flat, table, flat.numel(), per, world, j0, count, BLOCK=block, BPP=BLOCKS_PER_PROGRAM,
        TINY=TINY_SCALE, LIFT_F=LIFT, USE_ASM=USE_ASM, num_warps=4)


def sum_requantize_rows_triton(rows: torch.Tensor, table: torch.Tensor, per: int, block: int,
                               chunk: tuple[int, int] | None = None) -> None:
    """Sum the W rows [W, row_bytes] (float32, row 0 first), requantize, store at every row in `table`."""
    j0, count = _chunk(per, chunk)
    _sum_requantize_rows[_grid(triton.cdiv(count, BLOCKS_PER_PROGRAM))](
        rows, rows.stride(0), rows.shape[0], table, table.numel(), per, j0, count,
        BLOCK=block, BPP=BLOCKS_PER_PROGRAM, TINY=TINY_SCALE, LIFT_F=LIFT, USE_ASM=USE_ASM, num_warps=4)


def dequantize_rows_triton(rows: torch.Tensor, out: torch.Tensor, per: int, block: int, divisor: int = 1,
                           chunk: tuple[int, int] | None = None) -> None:
    """Write the values of rows [W, row_bytes] (row d = blocks [d*per, (d+1)*per)) into the contiguous flat
    `out` (its dtype, first out.numel() values), each scale divided by `divisor` first."""
    j0, count = _chunk(per, chunk)
    world = rows.shape[0]
    _dequantize_rows[_grid(world * triton.cdiv(count, BLOCKS_PER_PROGRAM))](
        rows, rows.stride(0), out, out.numel(), per, world, j0, count, divisor,
        BLOCK=block, BPP=BLOCKS_PER_PROGRAM, DIVIDE=divisor != 1, num_warps=4)
