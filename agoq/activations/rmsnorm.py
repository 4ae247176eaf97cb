"""RMSNorm forward and backward as single-pass kernels, with the torch reference beside them.

The formula is LLaMA's: h = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32.
The backward pass also rebuilds h when asked, so a layer that recomputes its norm output pays one
read of x for both. CUDA tensors use Triton; everything else uses the reference.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of x over its last dim, in torch ops (float32 statistics, result in x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_backward_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                                want_output: bool = False):
    """(grad x, grad weight, output or None) of `rms_norm_reference` at x for output gradient `grad`."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * r
    nb = n.to(x.dtype)
    g = grad.float()
    grad_w = (g * nb.float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    dn = g * weight.float()
    dx = (r * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)
    return dx, grad_w, (weight * nb if want_output else None)


def _use_triton(*tensors: torch.Tensor, backend: str = "auto") -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    x, w = tensors[0], tensors[1]
    return x.is_cuda and w.dtype == x.dtype and x.shape[-1] <= 16384


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm forward (fused kernel on CUDA)."""
    if not _use_triton(x, weight, backend=backend):
        return rms_norm_reference(x, weight, eps)
    from agoq.activations.rmsnorm_triton import rms_norm_forward_triton

    return rms_norm_forward_triton(x, weight, eps)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                      want_output: bool = False, backend: str = "auto"):
    """(grad x, grad weight, output or None): RMSNorm backward, rebuilding the output if asked."""
    if not _use_triton(x, weight, backend=backend):
        return rms_norm_backward_reference(x, weight, eps, grad, want_output)
    from agoq.activations.rmsnorm_triton import rms_norm_backward_triton

    return rms_norm_backward_triton(x, weight, eps, grad, want_output)
