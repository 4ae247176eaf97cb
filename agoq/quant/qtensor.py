"""QTensor: a block-quantized tensor, packed densely, with everything needed to restore it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Format = Literal["int", "nf4"]
Rounding = Literal["nearest", "stochastic"]

MIN_BITS, MAX_BITS = 2, 8
MIN_BLOCK, MAX_BLOCK = 32, 4096
SCALE_BYTES = 4  # one float32 scale per block


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes taken by `numel` codes of `bits` bits packed densely: ceil(numel * bits / 8)."""
    return (numel * bits + 7) // 8


def num_blocks(numel: int, block: int) -> int:
    """Number of quantization blocks (one scale each) covering `numel` values."""
    return (numel + block - 1) // block


def quantized_nbytes(numel: int, bits: int, block: int) -> int:
    """Exact bytes of a QTensor of `numel` values: packed codes plus one float32 scale per block."""
    return packed_nbytes(numel, bits) + SCALE_BYTES * num_blocks(numel, block)


def int_qmax(bits: int) -> int:
    """Largest integer level of the symmetric `bits`-bit format: levels are -qmax..qmax."""
    return (1 << (bits - 1)) - 1


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

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Restore a tensor of the original shape (and strides) in `dtype` (default: the source dtype)."""
        from agoq.quant.quantize import dequantize

        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return (f"QTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
                f"block={self.block}, format={self.format!r}, nbytes={self.nbytes})")
