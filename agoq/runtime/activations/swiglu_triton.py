"""Triton kernels for `swiglu`: elementwise, one read of each input and one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agoq.triton_ops import register_kernels, wrap

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


def swiglu_forward_triton(gate: torch.Tensor, up: torch.Tensor, traced: bool = False) -> torch.Tensor:
    """silu(gate) * up in one pass. `traced`: launch through wrap_triton (an op body)."""
    g = gate if gate.is_contiguous() else gate.contiguous()
    u = up if up.is_contiguous() else up.contiguous()
    a = g.new_empty(g.shape)
    n = g.numel()
    if n:
        kernel = wrap(_swiglu_fwd) if traced else _swiglu_fwd
        kernel[(triton.cdiv(n, BLOCK),)](g, u, a, n, BLOCK=BLOCK, num_warps=8)
    return a


def swiglu_backward_triton(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, want_output: bool = False,
                           traced: bool = False):
    """(grad gate, grad up, output or None) in one pass. `traced`: launch through wrap_triton (an op body)."""
    g = gate if gate.is_contiguous() else gate.contiguous()
    u = up if up.is_contiguous() else up.contiguous()
    d = grad if grad.is_contiguous() else grad.contiguous()
    dg, du = g.new_empty(g.shape), u.new_empty(u.shape)
    a = g.new_empty(g.shape) if want_output else None
    n = g.numel()
    if n:
        # without WANT_A the output pointer is never written: an input stands in (not dg under a second name,
        # which would confuse the functionalization of a traced launch)
        kernel = wrap(_swiglu_bwd) if traced else _swiglu_bwd
        kernel[(triton.cdiv(n, BLOCK),)](g, u, d, dg, du, g if a is None else a, n, BLOCK=BLOCK, WANT_A=want_output,
                                         num_warps=8)
    return dg, du, a


register_kernels("agoq::swiglu", [_swiglu_fwd])
register_kernels("agoq::swiglu_backward", [_swiglu_bwd])
