"""The Triton kernel that restores a flat tensor from packed block-quantized codes and their scales.
`agoq.runtime.quant.reference.dequantize_reference` is its plain torch twin, bit for bit; `agoq.runtime.quant.block_triton`
launches it.

One program handles a tile of consecutive blocks; every load and store is a 2D [runs, 8] pointer grid
(see agoq.runtime.quant.quantize_kernel), consecutive lanes handling consecutive runs of 8 values. A run's codes
are `bits` bytes (2/4/8 bits: one vector load; odd widths: the 2 or 3 aligned words holding them, L1
hits shared with the neighbouring runs); one 16-byte store of 8 bf16 per run. An int code c means
(c - qmax) * scale, computed exactly as float32 bits; an nf4 code indexes the levels table.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequantize_kernel(
    data_ptr, scale_ptr, levels_ptr, out_ptr, n, nbytes, nblocks,
    BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, NF4: tl.constexpr,
):
    TILE: tl.constexpr = BLOCK * BPP
    NC: tl.constexpr = TILE // 8  # runs of 8 values, along lanes
    R: tl.constexpr = BLOCK // 8
    MASK: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * TILE
    rem = n - start
    full = rem >= TILE
    bstart = start * BITS // 8
    remb = nbytes - bstart

    # 2D [runs, 8] grids only (see agoq.runtime.quant.quantize_kernel): consecutive lanes handle consecutive runs
    c = tl.arange(0, NC)[:, None]
    e = tl.arange(0, 8)[None, :]
    loc = c * 8 + e
    dp = data_ptr + bstart
    if BITS == 8:
        if full:
            codes = tl.load(dp + loc).to(tl.uint32)
        else:
            codes = tl.load(dp + loc, mask=loc < remb, other=0).to(tl.uint32)
    elif BITS == 4 or BITS == 2:
        # a run is BITS bytes; byte i holds codes (8 // BITS) * i + s, s = 0 .. 8 // BITS - 1
        bl = c * BITS + tl.arange(0, BITS)[None, :]
        if full:
            by = tl.load(dp + bl).to(tl.uint32)
        else:
            by = tl.load(dp + bl, mask=bl < remb, other=0).to(tl.uint32)
        if BITS == 4:
            codes = tl.reshape(tl.join(by & 15, by >> 4), (NC, 8))
        else:
            codes = tl.reshape(tl.join(tl.join(by & 3, (by >> 4) & 3), tl.join((by >> 2) & 3, by >> 6)), (NC, 8))
    else:
        # odd widths: run c is bytes [c*BITS, c*BITS + BITS), inside words c*BITS//4 .. +1 (+2 for 7 bits);
        # the words are read straight from global memory (neighbouring runs share them: L1 hits)
        if full:
            byte0 = c * BITS
            wq = byte0 // 4
            o = ((byte0 % 4) * 8).to(tl.uint64)
            wp = dp.to(tl.pointer_type(tl.uint32))
            nw = remb // 4
            g0 = tl.load(wp + wq).to(tl.uint64)
            g1 = tl.load(wp + wq + 1, mask=wq + 1 < nw, other=0).to(tl.uint64)
            run = ((g1 << 32) | g0) >> o
            if BITS == 7:  # 7 bytes at a byte offset up to 3 can reach a third word
                g2 = tl.load(wp + wq + 2, mask=(wq + 2 < nw) & (o > 8), other=0).to(tl.uint64)
                run = run | (g2 << (64 - tl.where(o > 8, o, 16)))
        else:  # last tile: byte by byte
            addr = c * BITS + e
            byte = tl.load(dp + addr, mask=(e < BITS) & (addr < remb), other=0).to(tl.uint64)
            run = tl.sum(byte << (e * 8).to(tl.uint64), axis=1)[:, None]
        codes = ((run >> (e * BITS).to(tl.uint64)) & MASK).to(tl.uint32)

    # one scale per run (same address for the R runs of a block: one L1 transaction)
    sp = scale_ptr + pid.to(tl.int64) * BPP + c // R
    if full:
        scale = tl.load(sp)
    else:
        scale = tl.load(sp, mask=c // R < nblocks - pid.to(tl.int64) * BPP, other=0.0)
    if NF4:
        vals = tl.load(levels_ptr + codes)
    else:
        vals = (codes | 0x4B400000).to(tl.float32, bitcast=True) - (12582912.0 + QMAX)  # exact code - QMAX
    out = vals * scale
    op = out_ptr + start
    if full:
        tl.store(op + loc, out.to(out_ptr.dtype.element_ty))
    else:
        tl.store(op + loc, out.to(out_ptr.dtype.element_ty), mask=loc < rem)
