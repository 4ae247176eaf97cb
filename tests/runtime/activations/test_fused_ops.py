"""Fused RMSNorm and SwiGLU kernels: Triton vs torch reference vs float64 autograd."""

import pytest
import torch

from agoq.runtime.activations.rmsnorm import (
    rms_norm,
    rms_norm_backward,
    rms_norm_backward_reference,
    rms_norm_reference,
)
from agoq.runtime.activations.swiglu import (
    swiglu,
    swiglu_backward,
    swiglu_backward_reference,
    swiglu_reference,
)
from tests.backends import BACKENDS, DEVICE


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def f64_rmsnorm_grads(x, w, eps, g):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    h = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))
    h.backward(g.double())
    return h.detach(), xd.grad, wd.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rmsnorm_forward_backward(backend, dtype, tol, seed):
    rng = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 7, 203, generator=rng) * 2.3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(203, generator=rng)).to(dtype).to(DEVICE)
    g = torch.randn(3, 7, 203, generator=rng).to(dtype).to(DEVICE)
    eps = 1e-5
    h_ref, dx_ref, dw_ref = f64_rmsnorm_grads(x, w, eps, g)
    h = rms_norm(x, w, eps, backend=backend)
    dx, dw, h2 = rms_norm_backward(x, w, eps, g, want_output=True, backend=backend)
    assert rel(h, h_ref) < tol and rel(h2, h_ref) < tol
    assert rel(dx, dx_ref) < tol * 2 and rel(dw, dw_ref) < tol * 2
    # the fused backward rebuilds exactly what the forward gave, and matches the torch reference
    if dtype == torch.float32:
        assert torch.allclose(h, h2, rtol=1e-6, atol=1e-6)
    rdx, rdw, rh = rms_norm_backward_reference(x, w, eps, g, want_output=True)
    assert rel(dx, rdx) < tol and rel(dw, rdw) < tol and rel(h, rms_norm_reference(x, w, eps)) < tol
    dx3, dw3, none = rms_norm_backward(x, w, eps, g, want_output=False, backend=backend)
    assert none is None and torch.equal(dx3, dx) and torch.equal(dw3, dw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_swiglu_forward_backward(backend, dtype, tol, seed):
    rng = torch.Generator().manual_seed(seed)
    gate = (torch.randn(5, 3001, generator=rng) * 3).to(dtype).to(DEVICE)
    up = torch.randn(5, 3001, generator=rng).to(dtype).to(DEVICE)
    d = torch.randn(5, 3001, generator=rng).to(dtype).to(DEVICE)
    gd, ud = gate.double().requires_grad_(), up.double().requires_grad_()
    out = torch.nn.functional.silu(gd) * ud
    out.backward(d.double())
    a = swiglu(gate, up, backend=backend)
    dg, du, a2 = swiglu_backward(gate, up, d, want_output=True, backend=backend)
    assert rel(a, out.detach()) < tol and rel(a2, out.detach()) < tol
    assert rel(dg, gd.grad) < tol and rel(du, ud.grad) < tol
    rg, ru, _ = swiglu_backward_reference(gate, up, d)
    assert rel(dg, rg) < tol and rel(du, ru) < tol and rel(a, swiglu_reference(gate, up)) < tol
