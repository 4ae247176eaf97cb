"""The public entry points: `quantize` a float tensor to a QTensor, and `dequantize` it back.

CUDA tensors go through the Triton kernels, CPU tensors through the torch reference (or through the
Triton interpreter when TRITON_INTERPRET=1 and backend="triton"). Both produce identical bytes for
nearest rounding. backend "auto" goes through the torch operators `agoq::quantize_block` and
`agoq::dequantize_block` (agoq.runtime.quant.operators: torch.compile traces their CUDA bodies down to the Triton kernels).
"""

from __future__ import annotations

import torch

from agoq.runtime.quant.layout import FORMATS, ROUNDINGS, check_arguments  # noqa: F401  (the settings quantize takes)
from agoq.runtime.quant.operators import quantize_flat
from agoq.runtime.quant.qtensor import QTensor


def _flatten_dense(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """A flat view of x's memory if x is a permutation of a contiguous tensor (no copy), else a copy."""
    if x.is_contiguous():
        return x.reshape(-1), None
    order = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d))))
    permuted = x.permute(order)
    if permuted.is_contiguous():
        return permuted.reshape(-1), order
    return x.contiguous().reshape(-1), None


def quantize(
    x: torch.Tensor,
    bits: int,
    block: int = 128,
    rounding: str = "nearest",
    format: str = "int",
    *,
    seed: int | None = None,
    check_finite: bool = True,
    backend: str = "auto",
) -> QTensor:
    """Block-quantize a float tensor to `bits` bits (2..8), one float32 scale per `block` values.

    format "int": symmetric absmax levels -qmax..qmax with qmax = 2**(bits-1) - 1. format "nf4": the
    16-level normal-float codebook (bits must be 4). rounding "stochastic" is unbiased; its random
    stream comes from `seed`, or from torch's global generator when seed is None.
    Non-finite inputs: with check_finite (default) a ValueError is raised; without it, every value
    of a block that holds inf or NaN dequantizes to NaN.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize takes a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    check_arguments(bits, block, rounding, format)
    return quantize_unchecked(x, bits, block, rounding, format, seed=seed, check_finite=check_finite, backend=backend)


def quantize_unchecked(x: torch.Tensor, bits: int, block: int, rounding: str, format: str, *,
                       seed: int | None = None, check_finite: bool = True, backend: str = "auto") -> QTensor:
    """`quantize` without its argument check, for settings validated once already (a plan's or an activation
    policy's, checked where they were read): what LAAQ calls for every tensor it keeps, on the hot path. `x` must
    be a floating-point tensor and the settings what `check_arguments` accepts."""
    flat, order = _flatten_dense(x.detach())
    seed = seed if rounding == "stochastic" else None
    data, scales = quantize_flat(flat, bits, block, format, rounding, seed, backend)
    if check_finite and scales.numel() and not bool(torch.isfinite(scales).all()):
        bad = (~torch.isfinite(scales)).nonzero().flatten()
        raise ValueError(
            f"cannot quantize a tensor holding inf or NaN: {bad.numel()} of {scales.numel()} blocks of "
            f"{block} values are non-finite (first at element {int(bad[0]) * block}); fix the input, or "
            "pass check_finite=False to let those blocks dequantize to NaN")
    return QTensor(data, scales, x.shape, x.dtype, bits, block, format, order)


def dequantize(q: QTensor, dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Restore a QTensor to a float tensor of its original shape and strides, in `dtype` (default: source)."""
    return q.dequantize(dtype, backend)
