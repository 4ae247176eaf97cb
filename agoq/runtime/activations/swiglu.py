"""SwiGLU (silu(gate) * up) forward and backward in one pass each, with the torch reference beside.

The backward pass also rebuilds silu(gate) * up when asked, for the down projection's weight
gradient, so a layer that recomputes it reads gate and up once. CUDA tensors use Triton. Both directions are registered as torch operators
(`agoq::swiglu`, `agoq::swiglu_backward`, the forward differentiable), triton_ops whose CUDA bodies torch.compile
traces down to the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agoq.triton_ops import triton_operator


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
    from agoq.runtime.activations.swiglu_triton import swiglu_forward_triton

    return swiglu_forward_triton(gate, up)


def _backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, want_output: bool, backend: str):
    if not _use_triton(gate, up, backend):
        dg, du, a = swiglu_backward_reference(gate, up, grad, want_output)
        return dg.contiguous(), du.contiguous(), (a.contiguous() if want_output else None)
    from agoq.runtime.activations.swiglu_triton import swiglu_backward_triton

    return swiglu_backward_triton(gate, up, grad, want_output)


# The operators torch.compile sees, triton_ops (agoq.triton_ops): CPU kernel the reference; on CUDA the body
# launches the Triton kernel through wrap_triton (the reference's torch ops for mixed dtypes or broadcasting), and
# torch.compile traces that body. Contiguous outputs, the backward's rebuilt output an empty tensor when not wanted.


def _kernel_fits(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return gate.dtype == up.dtype and gate.shape == up.shape


def _swiglu_body(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not _kernel_fits(gate, up):
        return swiglu_reference(gate, up).contiguous()
    from agoq.runtime.activations.swiglu_triton import swiglu_forward_triton

    return swiglu_forward_triton(gate, up, traced=True)


def _swiglu_cpu(gate, up):
    return _forward(gate, up, "torch")


def _swiglu_fake(gate, up):
    return gate.new_empty(torch.broadcast_shapes(gate.shape, up.shape), dtype=torch.promote_types(gate.dtype, up.dtype))


def _on_cuda(gate, *args) -> bool:
    return gate.is_cuda


_swiglu_op = triton_operator("agoq::swiglu", _swiglu_body, cpu=_swiglu_cpu, fake=_swiglu_fake, decompose=_on_cuda)


def _swiglu_backward_body(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor,
                          want_output: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _kernel_fits(gate, up):
        dg, du, a = swiglu_backward_reference(gate, up, grad, want_output)
        return dg.contiguous(), du.contiguous(), (a.contiguous() if want_output else gate.new_empty(0))
    from agoq.runtime.activations.swiglu_triton import swiglu_backward_triton

    dg, du, a = swiglu_backward_triton(gate, up, grad, want_output, traced=True)
    return dg, du, (gate.new_empty(0) if a is None else a)


def _swiglu_backward_cpu(gate, up, grad, want_output):
    dg, du, a = _backward(gate, up, grad, want_output, "torch")
    return dg, du, (gate.new_empty(0) if a is None else a)


def _swiglu_backward_fake(gate, up, grad, want_output):
    a = _swiglu_fake(gate, up) if want_output else gate.new_empty(0)
    return gate.new_empty(gate.shape), up.new_empty(up.shape), a


_swiglu_backward_op = triton_operator("agoq::swiglu_backward", _swiglu_backward_body, cpu=_swiglu_backward_cpu,
                                      fake=_swiglu_backward_fake, decompose=_on_cuda)


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
