"""SwiGLU (silu(gate) * up) forward and backward in one pass each, with the torch reference beside.

The backward pass also rebuilds silu(gate) * up when asked, for the down projection's weight
gradient, so a layer that recomputes it reads gate and up once. CUDA tensors use Triton. Both directions are registered as torch operators
(`agoq::swiglu`, `agoq::swiglu_backward`, the forward differentiable) that torch.compile traces as opaque calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in torch ops."""
    return F.silu(gate) * up


def swiglu_backward_reference(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, want_output: bool = False):
    """(grad gate, grad up, output or None) of `swiglu_reference` for output gradient `grad`."""
    g, u, d = gate.float(), up.float(), grad.float()
    sig = torch.sigmoid(g)
    d_up = (d * g * sig).to(up.dtype)
    d_gate = (d * u * sig * (1.0 + g * (1.0 - sig))).to(gate.dtype)
    return d_gate, d_up, (swiglu_reference(gate, up) if want_output else None)


def _use_triton(gate: torch.Tensor, up: torch.Tensor, backend: str) -> bool:
    if backend != "auto":
        return backend == "triton"
    return gate.is_cuda and gate.dtype == up.dtype and gate.shape == up.shape


def _forward(gate: torch.Tensor, up: torch.Tensor, backend: str) -> torch.Tensor:
    if not _use_triton(gate, up, backend):
        return swiglu_reference(gate, up).contiguous()
    from agoq.activations.swiglu_triton import swiglu_forward_triton

    return swiglu_forward_triton(gate, up)


def _backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, want_output: bool, backend: str):
    if not _use_triton(gate, up, backend):
        dg, du, a = swiglu_backward_reference(gate, up, grad, want_output)
        return dg.contiguous(), du.contiguous(), (a.contiguous() if want_output else None)
    from agoq.activations.swiglu_triton import swiglu_backward_triton

    return swiglu_backward_triton(gate, up, grad, want_output)


# The operators torch.compile sees: CPU kernel the reference, CUDA kernel the Triton one; contiguous outputs,
# the backward's rebuilt output an empty tensor when it is not wanted.


@torch.library.custom_op("agoq::swiglu", mutates_args=(), device_types="cpu")
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate, up, "torch")


@_swiglu_op.register_kernel("cuda")
def _swiglu_cuda(gate, up):
    return _forward(gate, up, "auto")


@_swiglu_op.register_fake
def _swiglu_fake(gate, up):
    return gate.new_empty(torch.broadcast_shapes(gate.shape, up.shape), dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("agoq::swiglu_backward", mutates_args=(), device_types="cpu")
def _swiglu_backward_op(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor,
                        want_output: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dg, du, a = _backward(gate, up, grad, want_output, "torch")
    return dg, du, (gate.new_empty(0) if a is None else a)


@_swiglu_backward_op.register_kernel("cuda")
def _swiglu_backward_cuda(gate, up, grad, want_output):
    dg, du, a = _backward(gate, up, grad, want_output, "auto")
    return dg, du, (gate.new_empty(0) if a is None else a)


@_swiglu_backward_op.register_fake
def _swiglu_backward_fake(gate, up, grad, want_output):
    a = _swiglu_fake(gate, up) if want_output else gate.new_empty(0)
    return gate.new_empty(gate.shape), up.new_empty(up.shape), a


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, grad):
    gate, up = ctx.saved_tensors
    dg, du, _ = torch.ops.agoq.swiglu_backward(gate, up, grad, False)
    return dg, du


_swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up (fused kernel on CUDA); differentiable. backend "auto" goes through the `agoq::swiglu`
    operator (what torch.compile traces), "torch" / "triton" call that implementation directly."""
    if backend == "auto":
        return torch.ops.agoq.swiglu(gate, up)
    return _forward(gate, up, backend)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, want_output: bool = False,
                    backend: str = "auto"):
    """(grad gate, grad up, output or None): SwiGLU backward, rebuilding the output if asked
    (backend "auto": through the `agoq::swiglu_backward` operator)."""
    if backend == "auto":
        dg, du, a = torch.ops.agoq.swiglu_backward(gate, up, grad, want_output)
        return dg, du, (a if want_output else None)
    return _backward(gate, up, grad, want_output, backend)
