"""Triton kernels for `rmsnorm`: one program per row forward; backward loops over a strip of rows
and accumulates the weight gradient in registers, leaving one partial row per program."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from agoq.triton_ops import register_kernels, wrap


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


@functools.lru_cache(maxsize=None)
def _row_meta(C: int) -> tuple[int, int]:
    block = triton.next_power_of_2(C)
    return block, _warps(block)


@functools.lru_cache(maxsize=None)
def _programs_per_device(device: torch.device) -> int:
    """Backward programs: 4 per SM on a GPU (looked up once per device), 4 elsewhere (the interpreter)."""
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, traced: bool = False) -> torch.Tensor:
    """RMSNorm forward of x [..., C] in one pass. `traced`: launch through wrap_triton (an op body)."""
    x2 = x if x.is_contiguous() else x.contiguous()
    C = x2.shape[-1]
    h = x2.new_empty(x2.shape)
    rows = x2.numel() // C
    if rows:
        block, warps = _row_meta(C)
        kernel = wrap(_rms_norm_fwd) if traced else _rms_norm_fwd
        kernel[(rows,)](x2, weight, h, C, eps, BLOCK_C=block, num_warps=warps)
    return h


def rms_norm_backward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                             want_output: bool = False, traced: bool = False):
    """(grad x, grad weight, output or None) in one pass over x and grad. `traced`: launch through wrap_triton
    (an op body)."""
    x2 = x if x.is_contiguous() else x.contiguous()
    g2 = grad if grad.is_contiguous() else grad.contiguous()
    C = x2.shape[-1]
    rows = x2.numel() // C
    dx = x2.new_empty(x2.shape)
    h = x2.new_empty(x2.shape) if want_output else None
    if rows == 0:
        return dx, torch.zeros_like(weight), h
    programs = min(rows, _programs_per_device(x2.device))
    per = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, per)
    partial = x2.new_empty((programs, C), dtype=torch.float32)
    block, warps = _row_meta(C)
    kernel = wrap(_rms_norm_bwd) if traced else _rms_norm_bwd
    # without WANT_H the output pointer is never written: give it an input (a non-null pointer, and not dx
    # under a second name, which would confuse the functionalization of a traced launch)
    kernel[(programs,)](x2, weight, g2, dx, x2 if h is None else h, partial, rows, C, per, eps,
                        BLOCK_C=block, WANT_H=want_output, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype), h


register_kernels("agoq::rms_norm", [_rms_norm_fwd])
register_kernels("agoq::rms_norm_backward", [_rms_norm_bwd])
