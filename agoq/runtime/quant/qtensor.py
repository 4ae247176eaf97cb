"""QTensor: a block-quantized tensor, packed densely, with everything needed to restore it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from agoq.runtime.quant import operators
from agoq.runtime.quant.layout import (  # noqa: F401  (the layout's names, also importable from here)
    MAX_BITS,
    MAX_BLOCK,
    MIN_BITS,
    MIN_BLOCK,
    SCALE_BYTES,
    int_qmax,
    num_blocks,
    packed_nbytes,
    quantized_nbytes,
)

Format = Literal["int", "nf4"]
Rounding = Literal["nearest", "stochastic"]


@dataclass(frozen=True)
class QTensor:
    """A tensor stored as `bits`-bit codes packed LSB-first into bytes, with one scale per block.

    `data` holds ceil(n*bits/8) bytes (uint8) where value i occupies bits [i*bits, (i+1)*bits) of the
    little-endian bit stream; `scales` holds one float32 per `block` consecutive values. For the
    "int" format a code c means (c - qmax) * scale; for "nf4" it means nf4_levels[c] * scale.
    `order` is the permutation that made the source tensor contiguous (None when it already was), so
    transposed views are quantized without a copy and restored with their original strides.
    """

    data: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    block: int
    format: Format = "int"
    order: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        """Number of values represented."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Exact bytes held: packed codes plus float32 scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
        """Restore a tensor of the original shape and strides in `dtype` (default: the source dtype).

        `backend` as `agoq.runtime.quant.codec`'s: "auto" (the torch operator), "triton" or "torch"."""
        dtype = self.dtype if dtype is None else dtype
        flat = operators.dequantize_flat(self.data, self.scales, self.bits, self.block, self.numel, self.format,
                                         dtype, backend)
        if self.order is None:
            return flat.view(self.shape)
        permuted_shape = [self.shape[d] for d in self.order]
        inverse = [0] * len(self.order)
        for i, d in enumerate(self.order):
            inverse[d] = i
        return flat.view(permuted_shape).permute(inverse)

    def __repr__(self) -> str:
        return (f"QTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
                f"block={self.block}, format={self.format!r}, nbytes={self.nbytes})")
