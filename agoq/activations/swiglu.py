"""SwiGLU (silu(gate) * up) forward and backward in one pass each, with the torch reference beside.

The backward pass also rebuilds silu(gate) * up when asked, for the down projection's weight
gradient, so a layer that recomputes it reads gate and up once. CUDA tensors use Triton.
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


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up (fused kernel on CUDA)."""
    if not _use_triton(gate, up, backend):
        return swiglu_reference(gate, up)
    from agoq.activations.swiglu_triton import swiglu_forward_triton

    return swiglu_forward_triton(gate, up)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, want_output: bool = False,
                    backend: str = "auto"):
    """(grad gate, grad up, output or None): SwiGLU backward, rebuilding the output if asked."""
    if not _use_triton(gate, up, backend):
        return swiglu_backward_reference(gate, up, grad, want_output)
    from agoq.activations.swiglu_triton import swiglu_backward_triton

    return swiglu_backward_triton(gate, up, grad, want_output)
