"""Triton helpers shared by every quantizing kernel (block quantize, 8-bit wire rows, QuanGrad): the exact
rounding arithmetic of agoq.runtime.quant.reference, one operation and one rounding at a time.

Set TRITON_INTERPRET=1 before importing to run the kernels on CPU tensors (no inline PTX then: the same
arithmetic as plain float32 operations).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# inline PTX is used on the GPU only; the interpreter runs the same arithmetic as plain float32 ops
USE_ASM = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def mul_rn(x, m, USE_ASM: tl.constexpr):
    """RN(x * m), never fused with a later add."""
    if USE_ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, m], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x * m


@triton.jit
def floor_bits(x, m, u, MG: tl.constexpr, NEAREST: tl.constexpr, USE_ASM: tl.constexpr):
    """Bits (uint32) of MG + floor(RN(RN(x * m) + a)), a = 0.5 if NEAREST else u, where MG = 1.5 * 2**23 + an
    integer offset: the integer result sits in the low bits. Each operation rounds once, as in the
    reference (explicit .rn/.rm PTX is never contracted into an FMA)."""
    if USE_ASM:
        mg = tl.full([1, 1], MG, tl.float32)
        if NEAREST:
            t = tl.inline_asm_elementwise(
                "{ .reg .f32 t; mul.rn.f32 t, $1, $2; add.rn.f32 t, t, 0f3F000000; add.rm.f32 $0, t, $3; }",
                "=f,f,f,f", [x, m, mg], dtype=tl.float32, is_pure=True, pack=1)
        else:
            t = tl.inline_asm_elementwise(
                "{ .reg .f32 t; mul.rn.f32 t, $1, $2; add.rn.f32 t, t, $3; add.rm.f32 $0, t, $4; }",
                "=f,f,f,f,f", [x, m, u, mg], dtype=tl.float32, is_pure=True, pack=1)
    else:
        v = x * m
        if NEAREST:
            y = v + 0.5
        else:
            y = v + u
        t = tl.floor(y) + MG
    return t.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True)


@triton.jit
def sanitize(x, lift, inv, LIM: tl.constexpr):
    """The reference's v = (x * lift) * inv, NaN -> 0, clamped to [-LIM, LIM]."""
    v = (x * lift) * inv
    v = tl.where(v == v, v, 0.0)
    return tl.minimum(tl.maximum(v, -LIM), LIM)


INT8_QMAX = tl.constexpr(127)  # 8-bit levels -127..127, stored as code = level + 127
MAGIC_BITS = tl.constexpr(0x4B400000)  # bits of 1.5 * 2**23: floor_bits' results sit in the low mantissa bits


@triton.jit
def requantize_int8(v, TINY: tl.constexpr, LIFT_F: tl.constexpr, USE_ASM: tl.constexpr):
    """Codes (uint8 [R, BLOCK]) and scales ([R, 1] float32) of the float32 tile v, one block per row,
    exactly as agoq.runtime.quant.reference.quantize_reference at 8 bits (NaN scale for blocks holding inf/NaN)."""
    absmax = tl.reduce(tl.abs(v), 1, nanmax, keep_dims=True)
    s = tl.math.div_rn(absmax, INT8_QMAX * 1.0) + (absmax - absmax)
    lift = tl.where(s < TINY, LIFT_F, 1.0)
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s * lift, 1.0)), 0.0)
    bad = ((s < TINY) & (s > 0)) | (s != s)
    x = tl.where(bad, sanitize(v, lift, inv, INT8_QMAX * 1.0), v)
    m = tl.where(bad, 1.0, inv)
    t = floor_bits(x, m, 0.0, 12582912.0 + INT8_QMAX, True, USE_ASM)
    return (t - MAGIC_BITS).to(tl.uint8), s
