"""How a QTensor lays out its bytes: the bit widths and block sizes it supports, the bytes of its packed codes,
its blocks (one float32 scale each) and the integer levels of a width, and the settings it accepts
(`check_arguments`). Plain arithmetic, no tensors."""

from __future__ import annotations

MIN_BITS, MAX_BITS = 2, 8
MIN_BLOCK, MAX_BLOCK = 32, 4096
SCALE_BYTES = 4  # one float32 scale per block
FORMATS = ("int", "nf4")
ROUNDINGS = ("nearest", "stochastic")


def check_arguments(bits: int, block: int, rounding: str, fmt: str) -> None:
    """Raise ValueError with a clear message if a quantization setting is outside what is supported."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS}, got {bits!r} "
                         "(use 16, i.e. no quantization, by not calling quantize)")
    if isinstance(block, bool) or not isinstance(block, int) or not MIN_BLOCK <= block <= MAX_BLOCK \
            or block & (block - 1):
        raise ValueError(f"block must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}, got {block!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "nf4" and bits != 4:
        raise ValueError(f"format 'nf4' is a 4-bit codebook: bits must be 4, got {bits}")


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
