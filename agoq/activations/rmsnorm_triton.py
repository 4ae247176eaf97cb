"""Triton kernels for `rmsnorm`: one program per row forward; backward loops over a strip of rows
and accumulates the weight gradient in registers, leaving one partial row per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, h_ptr, C, eps, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    inside = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=inside, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
    n = (x * r).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * C + cols, (w * n).to(h_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rms_norm_bwd(x_ptr, w_ptr, g_ptr, dx_ptr, h_ptr, dw_ptr, T, C, rows_per_prog, eps,
                  BLOCK_C: tl.constexpr, WANT_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    inside = cols < C
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for i in range(0, rows_per_prog):
        row = pid.to(tl.int64) * rows_per_prog + i
        m = inside & ((cols * 0 + row) < T)
        x = tl.load(x_ptr + row * C + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * C + cols, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
        n = x * r
        nb = n.to(dx_ptr.dtype.element_ty).to(tl.float32)
        if WANT_H:
            tl.store(h_ptr + row * C + cols, (w * nb).to(h_ptr.dtype.element_ty), mask=m)
        acc += g * nb
        dn = g * w
        dot = tl.sum(dn * n, axis=0) / C
        tl.store(dx_ptr + row * C + cols, (r * (dn - n * dot)).to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + pid.to(tl.int64) * C + cols, acc, mask=inside)


def _warps(block_c: int) -> int:
    return 4 if block_c <= 1024 else (8 if block_c <= 4096 else 16)


def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm forward of x [..., C] in one pass."""
    x2 = x.contiguous()
    C = x2.shape[-1]
    h = torch.empty_like(x2)
    rows = x2.numel() // C
    if rows:
        block = triton.next_power_of_2(C)
        _rms_norm_fwd[(rows,)](x2, weight, h, C, eps, BLOCK_C=block, num_warps=_warps(block))
    return h


def rms_norm_backward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                             want_output: bool = False):
    """(grad x, grad weight, output or None) in one pass over x and grad."""
    x2, g2 = x.contiguous(), grad.contiguous()
    C = x2.shape[-1]
    rows = x2.numel() // C
    dx = torch.empty_like(x2)
    h = torch.empty_like(x2) if want_output else dx
    if rows == 0:
        return dx, torch.zeros_like(weight), (h if want_output else None)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    programs = min(rows, 4 * sms)
    per = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, per)
    partial = torch.empty(programs, C, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(C)
    _rms_norm_bwd[(programs,)](x2, weight, g2, dx, h, partial, rows, C, per, eps,
                               BLOCK_C=block, WANT_H=want_output, num_warps=_warps(block))
    return dx, partial.sum(0).to(weight.dtype), (h if want_output else None)
