"""How a QTensor lays out its bytes: the bit widths and block sizes it supports, the bytes of its packed codes,
its blocks (one float32 scale each) and the integer levels of a width. Plain arithmetic, no tensors."""

from __future__ import annotations

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
