"""The Triton kernel that block-quantizes a flat tensor: block scales, codes, and the codes packed densely.
`agoq.runtime.quant.reference.quantize_reference` is its plain torch twin, bit for bit; `agoq.runtime.quant.block_triton`
launches it.

Layout. One program handles a tile of consecutive blocks. Every load and store is a 2D [rows, vector]
pointer grid with a single non-contiguous dim, so that Triton puts rows on consecutive lanes whatever
its version (with several non-contiguous dims, 3.6 and 3.9 order lanes differently, and 3.6 ended up
with uncoalesced 16-byte accesses 256 bytes apart). Each thread owns a group of 32 consecutive values,
loaded as four runs of 8 (four 16-byte loads of bf16/fp16). Block absmax: max over the thread's 32 values,
then a few shuffles across the BLOCK / 32 lanes of a block; scales and their inverses cost 2 divisions
per 32 values. The 32 codes of a group are `bits` whole 32-bit words of the output bit stream, built in
registers with constant shifts: 2, 4, 8 bits store them as one 8/16/32-byte vector per thread
(coalesced); 3, 5, 6, 7 bits store each word directly (lanes `bits` words apart, but the warp writes
every byte of its span and L2 merges the sectors). Routing the words through shared memory (tl.gather)
so that consecutive lanes store consecutive words (ODD_GATHER) measured slower on an H200 at 2 warps
x 2048 values (3/5/6 bits: 82-85% vs 99-101% of copy; 7 bits: 86% vs 96%), faster for 7 bits only
at 4 warps x 4096 values (84% vs 74%).

Arithmetic is the reference's, rounding for rounding: v = RN(x * inv), code = floor(RN(v + 0.5)) + qmax.
On the GPU the three float operations are one inline-PTX block (mul.rn, add.rn, then add.rm of
1.5 * 2^23 + qmax, whose low mantissa bits are the code): explicit rounding modes are never contracted
into an FMA (the FMA-contracted x * inv + 0.5 rounded once and changed codes at ties), and no
float-to-int conversion instruction is needed. Under the interpreter (no PTX) plain float32 operations
give the same results. A tile holding a block with a subnormal-range (lifted) scale or a NaN scale
takes a branch that multiplies by the lift and sanitizes NaN / out-of-range values exactly like the
reference; other tiles skip that work: there |v| <= qmax * (1 + 2^-21), which cannot round past qmax.

nf4 nearest: v is mapped to one of 33 cells of width 1/16 (each holds at most one threshold, the
smallest gap being 0.08); one 8-byte load from a small table (L1-resident; built by
`agoq.runtime.quant.block_triton`) gives the cell's threshold and the number of thresholds below it, and a
single compare finishes the code.

Stochastic rounding draws 16 bits of noise per value from Philox (tl.randint4x with ROUNDS rounds: one
call gives 128 bits, i.e. 8 values): u = (k + 1/2) / 2^16, so rounding is unbiased to within 2^-17 of a
level step (plus the float rounding of v + u, as in the reference). 7 rounds (Philox4x32-7 still passes
BigCrush per its authors) instead of Triton's default 10 save ~10% time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from agoq.runtime.quant.triton_common import floor_bits, mul_rn, nanmax, sanitize


@triton.jit
def _noise(seed, run, ROUNDS: tl.constexpr):
    """[NG, 8] uniform noise (k + 1/2) / 2**16, k in [0, 2**16): 16 bits per value, one Philox call
    (tl.randint4x, 4 x 32 bits) per run of 8 values; `run` is the [NG] global run index."""
    r0, r1, r2, r3 = tl.randint4x(seed, run, ROUNDS)
    e = tl.arange(0, 8)[None, :]
    r = tl.where(e < 4, tl.where(e < 2, r0[:, None], r1[:, None]), tl.where(e < 6, r2[:, None], r3[:, None]))
    k = tl.where((e % 2) == 0, r & 0xFFFF, r >> 16)
    f = (k | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + k / 2**23, exactly
    return f * 128.0 + (2.0**-17 - 128.0)  # (k + 1/2) / 2**16, exactly (with or without FMA)


@triton.jit
def _encode(x, ms, seed, run, lut_ptr, QMAX: tl.constexpr, NF4: tl.constexpr, STOCHASTIC: tl.constexpr,
            USE_ASM: tl.constexpr, NF4_CELLS: tl.constexpr, ROUNDS: tl.constexpr):
    """MAGIC bits + code (uint32) of a run tensor x [NG, 8] scaled by ms [NG, 1]."""
    MB: tl.constexpr = 0x4B400000
    if STOCHASTIC:
        u = _noise(seed, run, ROUNDS)
    else:
        u = 0.0
    if NF4:
        v = mul_rn(x, ms, USE_ASM)
        # v * NF4_CELLS is exact: the cell index rint(v * NF4_CELLS) + NF4_CELLS is the same with or without FMA
        cell = (v * NF4_CELLS + (12582912.0 + NF4_CELLS)).to(tl.int32, bitcast=True) & 127
        if STOCHASTIC:
            ent = tl.load(lut_ptr + 128 + cell)  # (level in the cell or +inf, levels[1:15] below the cell)
            lvl = (ent & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            low = (ent >> 32).to(tl.int32) + (v >= lvl).to(tl.int32)
            seg = tl.load(lut_ptr + 256 + low)  # (levels[low], levels[low + 1] - levels[low])
            lo = (seg & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            width = (seg >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
            tb = (low + (lo + u * width < v).to(tl.int32)).to(tl.uint32) + MB
        else:
            # (threshold in the cell or +inf, MAGIC + number of thresholds below the cell, as floats)
            ent = tl.load(lut_ptr + cell)
            thr = (ent & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            below = (ent >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
            tb = (below + (v > thr).to(tl.float32)).to(tl.uint32, bitcast=True)
    else:
        if STOCHASTIC:
            tb = floor_bits(x, ms, u, 12582912.0 + QMAX, False, USE_ASM)
            tb = tl.minimum(tl.maximum(tb, MB), MB + 2 * QMAX)
        else:
            tb = floor_bits(x, ms, u, 12582912.0 + QMAX, True, USE_ASM)
    return tb


@triton.jit
def _store_tail_bytes(bptr, word, nvalid):
    """Store the low `nvalid` (< 4) bytes of the scalar uint32 `word` at byte pointer `bptr`."""
    k = tl.arange(0, 4)
    tl.store(bptr + k, ((word >> (k * 8).to(tl.uint32)) & 255).to(tl.uint8), mask=k < nvalid)


@triton.jit
def _stack4(a0, a1, a2, a3):
    """[N] x 4 -> [N, 4] (column k = a_k), all in one thread's registers."""
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (a0.shape[0], 4))


@triton.jit
def _pick4(a0, a1, a2, a3, k: tl.constexpr):
    if k == 0:
        return a0
    elif k == 1:
        return a1
    elif k == 2:
        return a2
    else:
        return a3


@triton.jit
def _shifted(x, s: tl.constexpr):
    """x << s for s > 0, x >> -s for s < 0 (uint32, |s| < 32)."""
    if s > 0:
        return x << s
    elif s < 0:
        return x >> (-s)
    else:
        return x


@triton.jit
def _word(l0, l1, l2, l3, h0, h1, h2, h3, j: tl.constexpr, BITS: tl.constexpr):
    """Word j (32 bits) of a group of 4 runs, run k being bits [8*BITS*k, 8*BITS*(k+1)) of the group's
    stream with its first 32 bits in l_k and the rest in h_k. Zero for j >= BITS."""
    w = l0 * 0
    if j < BITS:
        for k in tl.static_range(4):
            off = 8 * (k * BITS - 4 * j)  # bit offset of run k from the word's start
            if off < 32 and off > -8 * BITS:
                if off > -32:
                    w = w | _shifted(_pick4(l0, l1, l2, l3, k), off)
                if BITS > 4 and off < 0:
                    w = w | _shifted(_pick4(h0, h1, h2, h3, k), off + 32)
    return w


@triton.jit
def _run_lo_hi(tb, BITS: tl.constexpr):
    """A run's 8 codes (from tb = MAGIC bits + code) as 8*BITS bits: (bits 0..31, bits 32..)."""
    code = tb & ((1 << BITS) - 1)
    es = tl.arange(0, 8)[None, :] * BITS
    lo = tl.sum(tl.where(es < 32, code << tl.where(es < 32, es, 0).to(tl.uint32), 0), axis=1)
    hsh = tl.where(es >= 32, code << tl.where(es >= 32, es - 32, 0).to(tl.uint32),
                   code >> tl.where(es < 32, tl.minimum(32 - es, 31), 0).to(tl.uint32))
    hi = tl.sum(tl.where(es + BITS > 32, hsh, 0), axis=1)
    return lo, hi


@triton.jit
def _gather_store(src, wp, w0: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, FULL: tl.constexpr, nfw):
    """Output words [w0, w0 + P) of the tile from src ([groups * 8]: word j of group g at g*8 + j),
    stored one per lane; returns the partial last word (index nfw) or 0."""
    w = w0 + tl.arange(0, P)
    word = tl.gather(src, (w // BITS) * 8 + w % BITS, 0)
    if FULL:
        tl.store(wp + w, word)
        return 0
    else:
        tl.store(wp + w, word, mask=w < nfw)
        return tl.sum(tl.where(w == nfw, word, 0), axis=0)


@triton.jit
def _gather_store_all(src, wp, NG: tl.constexpr, BITS: tl.constexpr, FULL: tl.constexpr, nfw):
    """All NG*BITS words of the tile, as pieces of 4, 2 and 1 times NG words (power-of-two sizes)."""
    tail = 0
    if (BITS & 4) != 0:
        tail += _gather_store(src, wp, 0, 4 * NG, BITS, FULL, nfw)
    if (BITS & 2) != 0:
        tail += _gather_store(src, wp, (BITS & 4) * NG, 2 * NG, BITS, FULL, nfw)
    if (BITS & 1) != 0:
        tail += _gather_store(src, wp, (BITS & 6) * NG, NG, BITS, FULL, nfw)
    return tail


@triton.jit
def quantize_kernel(
    x_ptr, data_ptr, scale_ptr, lut_ptr, n, nbytes, nblocks, seed,
    BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr,
    NF4: tl.constexpr, STOCHASTIC: tl.constexpr, TINY: tl.constexpr, LIFT_F: tl.constexpr,
    USE_ASM: tl.constexpr, NF4_CELLS: tl.constexpr, ROUNDS: tl.constexpr, PACK_C: tl.constexpr,
    ODD_GATHER: tl.constexpr,
):
    TILE: tl.constexpr = BLOCK * BPP
    NG: tl.constexpr = TILE // 32  # groups of 32 values (4 runs of 8): one per thread and repetition
    RL: tl.constexpr = BLOCK // 32  # groups per block
    MB: tl.constexpr = 0x4B400000  # bits of MAGIC
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * TILE
    rem = n - start  # values left from the tile's start
    full = rem >= TILE

    # Every memory access below is a 2D [rows, contiguous] grid (a single non-contiguous dim: Triton
    # then lays rows along lanes in every version). Run k of group g is values g*32 + 8k .. + 8, in a
    # separate tensor per k, all four with the same layout: one thread holds a whole group.
    g = tl.arange(0, NG)[:, None]
    e = tl.arange(0, 8)[None, :]
    loc = g * 32 + e
    xp = x_ptr + start
    if full:
        x0 = tl.load(xp + loc).to(tl.float32)
        x1 = tl.load(xp + loc + 8).to(tl.float32)
        x2 = tl.load(xp + loc + 16).to(tl.float32)
        x3 = tl.load(xp + loc + 24).to(tl.float32)
    else:
        x0 = tl.load(xp + loc, mask=loc < rem, other=0.0).to(tl.float32)
        x1 = tl.load(xp + loc + 8, mask=loc + 8 < rem, other=0.0).to(tl.float32)
        x2 = tl.load(xp + loc + 16, mask=loc + 16 < rem, other=0.0).to(tl.float32)
        x3 = tl.load(xp + loc + 24, mask=loc + 24 < rem, other=0.0).to(tl.float32)

    # block scales: absmax (NaN as soon as a value is NaN, inf stays inf), then NaN for non-finite blocks
    a = nanmax(nanmax(tl.abs(x0), tl.abs(x1)), nanmax(tl.abs(x2), tl.abs(x3)))
    gmax = tl.reduce(a, 1, nanmax)  # [NG]
    absmax = tl.reduce(tl.reshape(gmax, (BPP, RL)), 1, nanmax, keep_dims=True)  # [BPP, 1]
    if NF4:
        scale = absmax + (absmax - absmax)
    else:
        scale = tl.math.div_rn(absmax, QMAX * 1.0) + (absmax - absmax)
    bidx = tl.arange(0, BPP)[:, None]
    if full:
        tl.store(scale_ptr + pid.to(tl.int64) * BPP + bidx, scale)
    else:
        tl.store(scale_ptr + pid.to(tl.int64) * BPP + bidx, scale, mask=bidx < nblocks - pid.to(tl.int64) * BPP)
    lift = tl.where(scale < TINY, LIFT_F, 1.0)
    inv = tl.where(scale > 0, tl.math.div_rn(1.0, tl.where(scale > 0, scale * lift, 1.0)), 0.0)
    inv_g = tl.reshape(tl.broadcast_to(inv, (BPP, RL)), (NG, 1))

    # fast path unless a block is lifted (0 < scale < TINY) or poisoned (NaN scale)
    bad = ((scale < TINY) & (scale > 0)) | (scale != scale)
    if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) == 0:
        ms = inv_g
    else:
        LIM: tl.constexpr = 1.0 if NF4 else QMAX * 1.0
        lift_g = tl.reshape(tl.broadcast_to(lift, (BPP, RL)), (NG, 1))
        # exactly the reference's (x * lift) * inv; NaN -> 0 (poisoned blocks: the NaN scale carries the
        # error); subnormal scales are inexact, so v may pass qmax: clamp (the reference clamps codes).
        # The scale is then 1 (x * 1 is exact).
        x0 = sanitize(x0, lift_g, inv_g, LIM)
        x1 = sanitize(x1, lift_g, inv_g, LIM)
        x2 = sanitize(x2, lift_g, inv_g, LIM)
        x3 = sanitize(x3, lift_g, inv_g, LIM)
        ms = tl.zeros_like(inv_g) + 1.0

    run = start // 8 + tl.arange(0, NG).to(tl.int64) * 4  # global index of run 0 of each group
    t0 = _encode(x0, ms, seed, run, lut_ptr, QMAX, NF4, STOCHASTIC, USE_ASM, NF4_CELLS, ROUNDS)
    t1 = _encode(x1, ms, seed, run + 1, lut_ptr, QMAX, NF4, STOCHASTIC, USE_ASM, NF4_CELLS, ROUNDS)
    t2 = _encode(x2, ms, seed, run + 2, lut_ptr, QMAX, NF4, STOCHASTIC, USE_ASM, NF4_CELLS, ROUNDS)
    t3 = _encode(x3, ms, seed, run + 3, lut_ptr, QMAX, NF4, STOCHASTIC, USE_ASM, NF4_CELLS, ROUNDS)
    if not full:  # codes past the end are 0: the last byte's unused high bits
        t0 = tl.where(loc < rem, t0, MB)
        t1 = tl.where(loc + 8 < rem, t1, MB)
        t2 = tl.where(loc + 16 < rem, t2, MB)
        t3 = tl.where(loc + 24 < rem, t3, MB)

    bstart = start * BITS // 8  # the tile's first output byte (TILE * BITS is a multiple of 32)
    remb = nbytes - bstart  # output bytes from the tile's start
    if BITS == 8:
        # [NG, 8, 2, 2] -> [NG, 2, 2, 8] -> [NG, 32]: a group's 32 code bytes in order
        cb = tl.join(tl.join(t0.to(tl.uint8), t2.to(tl.uint8)), tl.join(t1.to(tl.uint8), t3.to(tl.uint8)))
        cb = tl.reshape(tl.permute(cb, (0, 2, 3, 1)), (NG, 32))
        bl = tl.arange(0, NG)[:, None] * 32 + tl.arange(0, 32)[None, :]
        if full:
            tl.store(data_ptr + bstart + bl, cb)
        else:
            tl.store(data_ptr + bstart + bl, cb, mask=bl < remb)
    elif BITS == 4 or BITS == 2:
        # a run is one 8*BITS-bit word: sum(tb << s) = sum(code << s) + sum(MB << s); PACK_C removes the latter
        sh = (e * BITS).to(tl.uint32)
        w = _stack4(tl.sum(t0 << sh, axis=1) + PACK_C, tl.sum(t1 << sh, axis=1) + PACK_C,
                    tl.sum(t2 << sh, axis=1) + PACK_C, tl.sum(t3 << sh, axis=1) + PACK_C)  # [NG, 4]
        wl = tl.arange(0, NG)[:, None] * 4 + tl.arange(0, 4)[None, :]
        if BITS == 4:
            up = (data_ptr + bstart).to(tl.pointer_type(tl.uint32))
            uw = w
        else:
            up = (data_ptr + bstart).to(tl.pointer_type(tl.uint16))
            uw = w.to(tl.uint16)
        if full:
            tl.store(up + wl, uw)
        else:
            tl.store(up + wl, uw, mask=wl < remb // BITS)
            tail = tl.sum(tl.sum(tl.where(wl == remb // BITS, w, 0), axis=1), axis=0)
            _store_tail_bytes(data_ptr + bstart + (remb // BITS) * BITS, tail, remb % BITS)
    else:
        # a group's 32 codes are BITS whole 32-bit words of the stream: word j of group g is word g*BITS + j
        l0, h0 = _run_lo_hi(t0, BITS)
        l1, h1 = _run_lo_hi(t1, BITS)
        l2, h2 = _run_lo_hi(t2, BITS)
        l3, h3 = _run_lo_hi(t3, BITS)
        wp = (data_ptr + bstart).to(tl.pointer_type(tl.uint32))
        nfw = remb // 4  # whole output words from the tile's start
        if ODD_GATHER:
            # through shared memory (tl.gather), so that consecutive lanes store consecutive words
            src = tl.join(_stack4(_word(l0, l1, l2, l3, h0, h1, h2, h3, 0, BITS),
                                  _word(l0, l1, l2, l3, h0, h1, h2, h3, 2, BITS),
                                  _word(l0, l1, l2, l3, h0, h1, h2, h3, 4, BITS),
                                  _word(l0, l1, l2, l3, h0, h1, h2, h3, 6, BITS)),
                          _stack4(_word(l0, l1, l2, l3, h0, h1, h2, h3, 1, BITS),
                                  _word(l0, l1, l2, l3, h0, h1, h2, h3, 3, BITS),
                                  _word(l0, l1, l2, l3, h0, h1, h2, h3, 5, BITS),
                                  _word(l0, l1, l2, l3, h0, h1, h2, h3, 7, BITS)))
            src = tl.reshape(src, (NG * 8,))  # word j of group g at g*8 + j
            if full:
                _gather_store_all(src, wp, NG, BITS, True, nfw)
            else:
                tail = _gather_store_all(src, wp, NG, BITS, False, nfw)
                _store_tail_bytes(data_ptr + bstart + nfw * 4, tail.to(tl.uint32), remb % 4)
        else:
            gi = tl.arange(0, NG) * BITS
            tail = tl.zeros((NG,), tl.uint32)
            for j in tl.static_range(BITS):
                word = _word(l0, l1, l2, l3, h0, h1, h2, h3, j, BITS)
                if full:
                    tl.store(wp + gi + j, word)
                else:
                    tl.store(wp + gi + j, word, mask=gi + j < nfw)
                    tail = tail | tl.where(gi + j == nfw, word, 0)
            if not full:
                _store_tail_bytes(data_ptr + bstart + nfw * 4, tl.sum(tail, axis=0), remb % 4)
