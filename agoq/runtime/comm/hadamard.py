"""The orthonormal 32-point Walsh-Hadamard transform, applied to each group of 32 consecutive values.

H = S / sqrt(32) where S is the 32x32 Sylvester matrix of +-1 (S[i, j] = (-1)**popcount(i & j)). H is
symmetric and orthonormal, so H @ H = I: the inverse transform is the transform itself. Spreading
each value over its 32-group flattens outliers before block quantization (TLq-HS in SDP4Bit).

The transform is a float32 matmul of a [-1, 32] view with H, built once per device. On CUDA it is
`hadamard_triton`'s kernel, whose product is IEEE float32 whatever the process allows for matmuls (TF32
would silently round the gradient to 10 mantissa bits before it is quantized), without touching any
global switch; on the CPU (no TF32) it is torch's matmul.
"""

from __future__ import annotations

import math

import torch

GROUP = 32
_MATRICES: dict[torch.device, torch.Tensor] = {}


def hadamard_matrix(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal 32x32 Walsh-Hadamard matrix (entries +-1/sqrt(32)) in `dtype` on `device`."""
    idx = torch.arange(GROUP)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    for k in range(5):
        parity ^= (bits >> k) & 1
    signs = 1.0 - 2.0 * parity.to(torch.float64)
    return (signs / math.sqrt(GROUP)).to(device=device, dtype=dtype)


def _matrix(device: torch.device) -> torch.Tensor:
    m = _MATRICES.get(device)
    if m is None:
        m = _MATRICES[device] = hadamard_matrix(device)
    return m


def _padded(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"the Hadamard transform takes a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    flat = x.reshape(-1).float()
    n = flat.numel()
    tail = (-n) % GROUP
    if tail:
        flat = torch.cat([flat, flat.new_zeros(tail)])
    return flat, n


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each group of 32 consecutive values of `x` (flattened).

    Returns a flat float32 tensor of x.numel() rounded up to a multiple of 32 values: a length that is
    not a multiple of 32 is padded with zeros first (and the result keeps the padded length, since the
    transformed tail group is needed to invert it). Values keep their units; L2 norms are preserved.
    """
    flat, _ = _padded(x)
    if flat.numel() == 0:
        return flat
    m = _matrix(flat.device)
    rows = flat.view(-1, GROUP)
    if rows.is_cuda:
        from agoq.runtime.comm.hadamard_triton import hadamard_rows_triton

        return hadamard_rows_triton(rows, m).reshape(-1)
    return (rows @ m).reshape(-1)


def inverse_hadamard32(x: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """Inverse of `hadamard32` (the same transform, since H @ H = I), as flat float32.

    `numel`, if given, trims the result to the first `numel` values (the length before padding).
    """
    out = hadamard32(x)
    return out if numel is None else out[:numel]
