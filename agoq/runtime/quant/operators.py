"""The torch operators `agoq::quantize_block` and `agoq::dequantize_block` over flat tensors, and the backend
that runs a call: the Triton kernels (`block_triton`) for CUDA tensors, or under the interpreter when
TRITON_INTERPRET=1; the torch reference (`reference`) for CPU tensors. Both give identical bytes for nearest
rounding. backend "auto" goes through the operators (triton_ops: torch.compile traces their CUDA bodies down
to the Triton kernels); "triton" and "torch" call one implementation directly.
"""

from __future__ import annotations

import os

import torch

from agoq.runtime.quant import reference as quant_reference
from agoq.runtime.quant.layout import num_blocks, packed_nbytes
from agoq.triton_ops import triton_operator

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


def _quantize_flat(flat: torch.Tensor, bits: int, block: int, fmt: str, rounding: str, seed: int | None,
                   which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales) of a flat tensor by the Triton kernel or the torch reference."""
    if rounding == "stochastic" and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # torch's global CPU generator: no device sync
    if which == "triton":
        from agoq.runtime.quant.block_triton import quantize_triton

        return quantize_triton(flat.contiguous(), bits, block, fmt, seed)
    noise = None
    if rounding == "stochastic":
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        noise = torch.rand(flat.numel(), generator=gen, device=flat.device)
    return quant_reference.quantize_reference(flat, bits, block, fmt, noise)


def _dequantize_flat(data: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, fmt: str,
                     dtype: torch.dtype, which: str) -> torch.Tensor:
    if which == "triton":
        from agoq.runtime.quant.block_triton import dequantize_triton

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
    from agoq.runtime.quant.block_triton import quantize_op_body

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
    from agoq.runtime.quant.block_triton import dequantize_op_body

    return dequantize_op_body(data, scales, bits, block, numel, fmt, dtype)


def _dequantize_cpu(data, scales, bits, block, numel, fmt, dtype):
    return _dequantize_flat(data, scales, bits, block, numel, fmt, dtype, "torch")


def _dequantize_fake(data, scales, bits, block, numel, fmt, dtype):
    return data.new_empty(numel, dtype=dtype)


def _dequantize_decomposes(data, scales, bits, block, numel, fmt, dtype) -> bool:
    return data.is_cuda and fmt != "nf4"


_dequantize_op = triton_operator("agoq::dequantize_block", _dequantize_body, cpu=_dequantize_cpu,
                                 fake=_dequantize_fake, decompose=_dequantize_decomposes)


def quantize_flat(flat: torch.Tensor, bits: int, block: int, fmt: str, rounding: str, seed: int | None,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 codes, float32 scales) of a flat tensor on `backend` ("auto": the operator); `seed` is
    used by stochastic rounding only (None: drawn from torch's global generator)."""
    which = _pick_backend(backend, flat.device)
    if backend == "auto":
        return torch.ops.agoq.quantize_block(flat, bits, block, fmt, rounding, seed)
    return _quantize_flat(flat, bits, block, fmt, rounding, seed, which)


def dequantize_flat(data: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int, fmt: str,
                    dtype: torch.dtype, backend: str) -> torch.Tensor:
    """The `numel` values (flat, `dtype`) that packed codes and scales stand for, on `backend`."""
    which = _pick_backend(backend, data.device)
    if backend == "auto":
        return torch.ops.agoq.dequantize_block(data, scales, bits, block, numel, fmt, dtype)
    return _dequantize_flat(data, scales, bits, block, numel, fmt, dtype, which)
