"""Triton kernel for `hadamard.hadamard32` on the GPU: each row of 32 float32 values times H, in IEEE float32.

The product is a `tl.dot` with `input_precision="ieee"`, so it never runs in TF32 whatever the process's
matmul settings are (a TF32 product would round the gradient to 10 mantissa bits before it is quantized),
and no global switch is touched: safe beside other threads. `hadamard.hadamard32` is its torch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 64  # rows of 32 values per program


@triton.jit
def _hadamard_rows(x_ptr, h_ptr, out_ptr, rows, ROWS: tl.constexpr, GROUP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, GROUP)
    inside = (r < rows)[:, None]
    x = tl.load(x_ptr + r[:, None] * GROUP + c[None, :], mask=inside, other=0.0)
    h = tl.load(h_ptr + c[:, None] * GROUP + c[None, :])
    y = tl.dot(x, h, input_precision="ieee")
    tl.store(out_ptr + r[:, None] * GROUP + c[None, :], y, mask=inside)


def hadamard_rows_triton(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """rows [R, 32] float32 (contiguous) @ matrix [32, 32] float32, in IEEE float32: a new [R, 32] tensor."""
    if rows.dtype != torch.float32 or matrix.dtype != torch.float32 or rows.dim() != 2 \
            or rows.shape[1] != matrix.shape[0] or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"hadamard_rows_triton takes float32 rows [R, n] and a float32 [n, n] matrix, got "
                         f"{rows.dtype} {tuple(rows.shape)} and {matrix.dtype} {tuple(matrix.shape)}")
    rows, matrix = rows.contiguous(), matrix.contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _hadamard_rows[(triton.cdiv(rows.shape[0], ROWS),)](rows, matrix, out, rows.shape[0], ROWS=ROWS,
                                                           GROUP=matrix.shape[0], num_warps=4)
    return out
