"""RMSNorm forward and backward as single-pass kernels, with the torch reference beside them.

The formula is LLaMA's: h = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32.
The backward pass also rebuilds h when asked, so a layer that recomputes its norm output pays one
read of x for both. CUDA tensors use Triton; everything else uses the reference. Both directions are
registered as torch operators (`agoq::rms_norm`, `agoq::rms_norm_backward`, the forward differentiable) so
that torch.compile traces them as single opaque calls.
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


def _use_triton(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return x.is_cuda and weight.dtype == x.dtype and x.shape[-1] <= 16384


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    if not _use_triton(x, weight, backend):
        return rms_norm_reference(x, weight, eps).contiguous()
    from agoq.activations.rmsnorm_triton import rms_norm_forward_triton

    return rms_norm_forward_triton(x, weight, eps)


def _backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor, want_output: bool,
              backend: str):
    if not _use_triton(x, weight, backend):
        dx, dw, h = rms_norm_backward_reference(x, weight, eps, grad, want_output)
        return dx.contiguous(), dw, (h.contiguous() if want_output else None)
    from agoq.activations.rmsnorm_triton import rms_norm_backward_triton

    return rms_norm_backward_triton(x, weight, eps, grad, want_output)


# The operators torch.compile sees (opaque to Dynamo, called as they are by Inductor): the CPU kernel is the
# reference, the CUDA kernel the Triton one. Outputs are contiguous, in x's shape (the weight gradient in
# the weight's); the backward's output is an empty tensor when it is not wanted.


@torch.library.custom_op("agoq::rms_norm", mutates_args=(), device_types="cpu")
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _forward(x, weight, eps, "torch")


@_rms_norm_op.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    return _forward(x, weight, eps, "auto")


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("agoq::rms_norm_backward", mutates_args=(), device_types="cpu")
def _rms_norm_backward_op(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                          want_output: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, h = _backward(x, weight, eps, grad, want_output, "torch")
    return dx, dw, (x.new_empty(0) if h is None else h)


@_rms_norm_backward_op.register_kernel("cuda")
def _rms_norm_backward_cuda(x, weight, eps, grad, want_output):
    dx, dw, h = _backward(x, weight, eps, grad, want_output, "auto")
    return dx, dw, (x.new_empty(0) if h is None else h)


@_rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(x, weight, eps, grad, want_output):
    h = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)) if want_output else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), h


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw, _ = torch.ops.agoq.rms_norm_backward(x, weight, ctx.eps, grad, False)
    return dx, dw, None


_rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm forward (fused kernel on CUDA); differentiable. backend "auto" goes through the `agoq::rms_norm`
    operator (what torch.compile traces), "torch" / "triton" call that implementation directly."""
    if backend == "auto":
        return torch.ops.agoq.rms_norm(x, weight, eps)
    return _forward(x, weight, eps, backend)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                      want_output: bool = False, backend: str = "auto"):
    """(grad x, grad weight, output or None): RMSNorm backward, rebuilding the output if asked
    (backend "auto": through the `agoq::rms_norm_backward` operator)."""
    if backend == "auto":
        dx, dw, h = torch.ops.agoq.rms_norm_backward(x, weight, eps, grad, want_output)
        return dx, dw, (h if want_output else None)
    return _backward(x, weight, eps, grad, want_output, backend)
