"""The public entry points: `quantize` a float tensor to a QTensor, and `dequantize` it back.

CUDA tensors go through the Triton kernels, CPU tensors through the torch reference (or through the
Triton interpreter when TRITON_INTERPRET=1 and backend="triton"). Both produce identical bytes for
nearest rounding. backend "auto" goes through the torch operators `agoq::quantize_block` and
`agoq::dequantize_block` (triton_ops: torch.compile traces their CUDA bodies down to the Triton kernels).
"""

from __future__ import annotations

import os

import torch

from agoq.quant import reference as quant_reference
from agoq.triton_ops import triton_operator
from agoq.quant.qtensor import MAX_BITS, MAX_BLOCK, MIN_BITS, MIN_BLOCK, QTensor, num_blocks, packed_nbytes

FORMATS = ("int", "nf4")
ROUNDINGS = ("nearest", "stochastic")
BACKENDS = ("auto", "triton", "torch")


def _triton_usable(device: torch.device) -> bool:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _pick_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    usable = _triton_usable(device)
    if backend == "triton" and not usable:
        raise RuntimeError(
            f"backend='triton' needs a CUDA tensor (got {device}) or TRITON_INTERPRET=1 set before "
            "agoq is imported, and the triton package; use backend='auto' or 'torch' on this machine")
    if backend == "auto":
        return "triton" if usable and device.type == "cuda" else "torch"
    return "triton"


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


def _flatten_dense(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """A flat view of x's memory if x is a permutation of a contiguous tensor (no copy), else a copy."""
    if x.is_contiguous():
        return x.reshape(-1), None
    order = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d))))
    permuted = x.permute(order)
    if permuted.is_contiguous():
        return permuted.reshape(-1), order
    return x.contiguous().reshape(-1), None


def _quantize_flat(flat: torch.Tensor, bits: int, block: int, fmt: str, rounding: str, seed: int | None,
                   which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales) of a flat tensor by the Triton kernel or the torch reference."""
    if rounding == "stochastic" and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # torch's global CPU generator: no device sync
    if which == "triton":
        from agoq.quant.block_triton import quantize_triton

        return quantize_triton(flat.contiguous(), bits, block, fmt, seed)
    noise = None
    if rounding == "stochastic":
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        noise = torch.rand(flat.numel(), generator=gen, device=flat.device)
    return quant_reference.quantize_reference(flat, bits, block, fmt, noise)


def _dequantize_flat(data: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, fmt: str,
                     dtype: torch.dtype, which: str) -> torch.Tensor:
    if which == "triton":
        from agoq.quant.block_triton import dequantize_triton

        return dequantize_triton(data, scales, bits, block, numel, fmt, dtype)
    return quant_reference.dequantize_reference(data, scales, bits, block, numel, fmt, dtype)


# The operators torch.compile sees (QTensor's metadata stays in Python), triton_ops (agoq.triton_ops): the CPU
# kernel is the torch reference; on CUDA the body allocates the outputs and launches the Triton kernel, and
# torch.compile traces that body, so Inductor launches the kernel from its own code. `x` is flat. Two cases stay
# one opaque call under torch.compile: nf4 (its lookup table is a device constant the trace would have to
# capture), and stochastic rounding with seed None, whose seed is drawn from torch's global CPU generator inside
# the call (no device sync; traced, it would be drawn once and frozen into the graph).


def _draw_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (1,)).item())  # a CPU tensor: no device sync


def _quantize_body(x: torch.Tensor, bits: int, block: int, fmt: str, rounding: str,
                   seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    from agoq.quant.block_triton import quantize_op_body

    if rounding == "stochastic" and seed is None:
        seed = _draw_seed()
    return quantize_op_body(x if x.is_contiguous() else x.contiguous(), bits, block, fmt,
                            seed if rounding == "stochastic" else None)


def _quantize_cpu(x, bits, block, fmt, rounding, seed):
    return _quantize_flat(x, bits, block, fmt, rounding, seed, "torch")


def _quantize_fake(x, bits, block, fmt, rounding, seed):
    n = x.numel()
    return (x.new_empty(packed_nbytes(n, bits), dtype=torch.uint8),
            x.new_empty(num_blocks(n, block), dtype=torch.float32))


def _quantize_decomposes(x, bits, block, fmt, rounding, seed) -> bool:
    return x.is_cuda and fmt != "nf4" and (rounding != "stochastic" or seed is not None)


_quantize_op = triton_operator("agoq::quantize_block", _quantize_body, cpu=_quantize_cpu, fake=_quantize_fake,
                               decompose=_quantize_decomposes)


def _dequantize_body(data: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, fmt: str,
                     dtype: torch.dtype) -> torch.Tensor:
    from agoq.quant.block_triton import dequantize_op_body

    return dequantize_op_body(data, scales, bits, block, numel, fmt, dtype)


def _dequantize_cpu(data, scales, bits, block, numel, fmt, dtype):
    return _dequantize_flat(data, scales, bits, block, numel, fmt, dtype, "torch")


def _dequantize_fake(data, scales, bits, block, numel, fmt, dtype):
    return data.new_empty(numel, dtype=dtype)


def _dequantize_decomposes(data, scales, bits, block, numel, fmt, dtype) -> bool:
    return data.is_cuda and fmt != "nf4"


_dequantize_op = triton_operator("agoq::dequantize_block", _dequantize_body, cpu=_dequantize_cpu,
                                 fake=_dequantize_fake, decompose=_dequantize_decomposes)


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
    which = _pick_backend(backend, x.device)
    flat, order = _flatten_dense(x.detach())
    seed = seed if rounding == "stochastic" else None
    if backend == "auto":
        data, scales = torch.ops.agoq.quantize_block(flat, bits, block, format, rounding, seed)
    else:
        data, scales = _quantize_flat(flat, bits, block, format, rounding, seed, which)
    if check_finite and scales.numel() and not bool(torch.isfinite(scales).all()):
        bad = (~torch.isfinite(scales)).nonzero().flatten()
        raise ValueError(
            f"cannot quantize a tensor holding inf or NaN: {bad.numel()} of {scales.numel()} blocks of "
            f"{block} values are non-finite (first at element {int(bad[0]) * block}); fix the input, or "
            "pass check_finite=False to let those blocks dequantize to NaN")
    return QTensor(data, scales, x.shape, x.dtype, bits, block, format, order)


def dequantize(q: QTensor, dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Restore a QTensor to a float tensor of its original shape and strides, in `dtype` (default: source)."""
    dtype = q.dtype if dtype is None else dtype
    which = _pick_backend(backend, q.device)
    if backend == "auto":
        flat = torch.ops.agoq.dequantize_block(q.data, q.scales, q.bits, q.block, q.numel, q.format, dtype)
    else:
        flat = _dequantize_flat(q.data, q.scales, q.bits, q.block, q.numel, q.format, dtype, which)
    if q.order is None:
        return flat.view(q.shape)
    permuted_shape = [q.shape[d] for d in q.order]
    inverse = [0] * len(q.order)
    for i, d in enumerate(q.order):
        inverse[d] = i
    return flat.view(permuted_shape).permute(inverse)
