"""RMSNorm forward and backward as single-pass kernels, with the torch reference beside them.

The formula is LLaMA's: h = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32.
The backward pass also rebuilds h when asked, so a layer that recomputes its norm output pays one
read of x for both. CUDA tensors use Triton; everything else uses the reference. Both directions are
registered as torch operators (`agoq::rms_norm`, `agoq::rms_norm_backward`, the forward differentiable), triton_ops
whose CUDA bodies torch.compile traces down to the Triton kernels.
"""

from __future__ import annotations

import torch

from agoq.triton_ops import triton_operator


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


def _kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return weight.dtype == x.dtype and x.shape[-1] <= 16384


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    if not _use_triton(x, weight, backend):
        return rms_norm_reference(x, weight, eps).contiguous()
    from agoq.runtime.activations.rmsnorm_triton import rms_norm_forward_triton

    return rms_norm_forward_triton(x, weight, eps)


def _backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor, want_output: bool,
              backend: str):
    if not _use_triton(x, weight, backend):
        dx, dw, h = rms_norm_backward_reference(x, weight, eps, grad, want_output)
        return dx.contiguous(), dw, (h.contiguous() if want_output else None)
    from agoq.runtime.activations.rmsnorm_triton import rms_norm_backward_triton

    return rms_norm_backward_triton(x, weight, eps, grad, want_output)


# The operators torch.compile sees, triton_ops (agoq.triton_ops): the CPU kernel is the reference; on CUDA the body
# launches the Triton kernel through wrap_triton (the reference's torch ops where the kernel does not apply: mixed
# dtypes, rows over 16384), and torch.compile traces that body. Outputs are contiguous, in x's shape (the weight
# gradient in the weight's); the backward's output is an empty tensor when it is not wanted.


def _rms_norm_body(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _kernel_fits(x, weight):
        return rms_norm_reference(x, weight, eps).contiguous()
    from agoq.runtime.activations.rmsnorm_triton import rms_norm_forward_triton

    return rms_norm_forward_triton(x, weight, eps, traced=True)


def _rms_norm_cpu(x, weight, eps):
    return _forward(x, weight, eps, "torch")


def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _on_cuda(x, *args) -> bool:
    return x.is_cuda


_rms_norm_op = triton_operator("agoq::rms_norm", _rms_norm_body, cpu=_rms_norm_cpu, fake=_rms_norm_fake,
                               decompose=_on_cuda)


def _rms_norm_backward_body(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor,
                            want_output: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _kernel_fits(x, weight):
        dx, dw, h = rms_norm_backward_reference(x, weight, eps, grad, want_output)
        return dx.contiguous(), dw, (h.contiguous() if want_output else x.new_empty(0))
    from agoq.runtime.activations.rmsnorm_triton import rms_norm_backward_triton

    dx, dw, h = rms_norm_backward_triton(x, weight, eps, grad, want_output, traced=True)
    return dx, dw, (x.new_empty(0) if h is None else h)


def _rms_norm_backward_cpu(x, weight, eps, grad, want_output):
    dx, dw, h = _backward(x, weight, eps, grad, want_output, "torch")
    return dx, dw, (x.new_empty(0) if h is None else h)


def _rms_norm_backward_fake(x, weight, eps, grad, want_output):
    h = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)) if want_output else x.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), h


_rms_norm_backward_op = triton_operator("agoq::rms_norm_backward", _rms_norm_backward_body,
                                        cpu=_rms_norm_backward_cpu, fake=_rms_norm_backward_fake, decompose=_on_cuda)


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
