"""Triton kernels for `swiglu`: elementwise, one read of each input and one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(a_ptr.dtype.element_ty).to(tl.float32)
    tl.store(a_ptr + offs, (silu * u).to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(g_ptr, u_ptr, d_ptr, dg_ptr, du_ptr, a_ptr, n, BLOCK: tl.constexpr, WANT_A: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    tl.store(du_ptr + offs, (d * silu).to(du_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + offs, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=m)
    if WANT_A:
        s = silu.to(a_ptr.dtype.element_ty).to(tl.float32)
        tl.store(a_ptr + offs, (s * u).to(a_ptr.dtype.element_ty), mask=m)


def swiglu_forward_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass."""
    g, u = gate.contiguous(), up.contiguous()
    a = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](g, u, a, n, BLOCK=BLOCK, num_warps=8)
    return a


def swiglu_backward_triton(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, want_output: bool = False):
    """(grad gate, grad up, output or None) in one pass."""
    g, u, d = gate.contiguous(), up.contiguous(), grad.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    a = torch.empty_like(g) if want_output else dg
    n = g.numel()
    if n:
        _swiglu_bwd[(triton.cdiv(n, BLOCK),)](g, u, d, dg, du, a, n, BLOCK=BLOCK, WANT_A=want_output, num_warps=8)
    return dg, du, (a if want_output else None)
