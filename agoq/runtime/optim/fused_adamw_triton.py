"""Triton kernels of the fused 8-bit AdamW step and of the gradient norm: one pass over what is stored.

`adamw_step_triton` updates a bucket of parameters in ONE launch. A small int64 table holds, per
parameter, the addresses of its gradient (QuanGrad's uint8 codes and float32 scales, or a dense
bf16 / float32 / float64 .grad), of its two 8-bit moments (float8 e4m3 codes, float32 scale per
`block` values), of its float32 master (or 0) and of the parameter itself, and its length; the
table is the same every step and stays on the device. A second table maps every program to
(parameter, tile). A program's tile is BPP whole moment blocks, so it requantizes its blocks
without talking to any other. Stochastic rounding (bf16 parameters without masters) reads one
seed per parameter from a third, per-step tensor, copied without a host sync, and draws 16
random bits per value, eight values per Philox call.
Per value it reads about 1 (grad code) + 2 (moment codes) + 4 (master) bytes and writes
2 + 4 + 2 (moments, master, bf16 parameter); no float32 copy of anything exists outside registers.

Every float operation is the one agoq.runtime.optim.fused_adamw.adamw_chunk_reference does, in the same
order, each product rounded on its own (mul_rn: never contracted into an FMA on the GPU), so the
interpreter (TRITON_INTERPRET=1) reproduces the reference's bytes exactly. float8 e4m3 and bf16
conversions are done with integer arithmetic (round to nearest even), because the interpreter's own
casts truncate; on the GPU the same code runs, so both agree with torch's `.to()`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from agoq.runtime.quant.triton_common import USE_ASM, mul_rn, nanmax

BLOCKS_PER_PROGRAM = 2  # moment blocks per program: 512 values at block 256 (fastest of 2..16 on an H200)
NUM_WARPS = 4  # warps per program of the step kernel
NORM_TILE = 4096  # values per program of the dense gradient-norm kernel
FIELDS = 9  # int64 words per parameter in the step's table (see adamw_step_triton)
PARAM_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float64: 2}
GRAD_KINDS = {"quangrad": 0, torch.float32: 1, torch.bfloat16: 2, torch.float64: 3}


@triton.jit
def _fp8_decode(c, NATIVE: tl.constexpr):
    """float32 value of float8 e4m3fn codes (int32 in [0, 256)): exact. NATIVE (the GPU): the hardware's
    conversion; else integer arithmetic (the interpreter's own casts are wrong for float8)."""
    if NATIVE:
        return c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2**(e-7) * (1 + m/8)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    v = tl.where((e == 15) & (m == 7), v - v + float("nan"), v)
    return tl.where(c >= 128, -v, v)


@triton.jit
def _fp8_encode(x, NATIVE: tl.constexpr):
    """float8 e4m3fn code (uint8) of float32 `x` with |x| <= 448, rounded to nearest even (as torch's .to()):
    the hardware's conversion on the GPU (NATIVE), integer arithmetic under the interpreter."""
    if NATIVE:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    r = a + 0x7FFFF + ((a >> 20) & 1)  # round the 23-bit mantissa to 3 bits, nearest even; carries into the exponent
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    af = a.to(tl.float32, bitcast=True)
    sub = (af * 512.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000  # RNE(|x| * 2**9): exact product
    code = tl.where(a >= 0x3C800000, normal, sub)  # 2**-6: the smallest normal
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def _bf16_load(ptr, off, mask):
    bits = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + off, mask=mask, other=0).to(tl.int32)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x, noise, STOCHASTIC: tl.constexpr):
    """bf16 bits (int32 in [0, 65536)) of float32 x: nearest even, or x + noise (16 random low bits) truncated."""
    bits = x.to(tl.int32, bitcast=True)
    if STOCHASTIC:
        r = bits + noise
    else:
        r = bits + 0x7FFF + ((bits >> 16) & 1)
    r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x400000, r)  # NaN stays a (quiet) NaN
    return (r >> 16) & 0xFFFF


@triton.jit
def _noise16(seed, t, BPP: tl.constexpr, BLOCK: tl.constexpr):
    """int32 [BPP, BLOCK] of 16 random bits per value of tile `t`: one Philox-4x32 call per 8 values (its four
    32-bit outputs split into halves), counters = the value's offset within the parameter // 8, so every value of
    a parameter draws its own bits from the stream of `seed`."""
    EIGHTHS: tl.constexpr = BPP * BLOCK // 8
    c = (t * EIGHTHS + tl.arange(0, EIGHTHS)).to(tl.uint32)
    r0, r1, r2, r3 = tl.randint4x(seed, c)
    h0 = tl.join(r0 & 0xFFFF, r0 >> 16)
    h1 = tl.join(r1 & 0xFFFF, r1 >> 16)
    h2 = tl.join(r2 & 0xFFFF, r2 >> 16)
    h3 = tl.join(r3 & 0xFFFF, r3 >> 16)
    eight = tl.join(tl.join(h0, h1), tl.join(h2, h3))  # [EIGHTHS, 2, 2, 2]: value 8c + 4a + 2b + d
    return tl.reshape(eight, (BPP, BLOCK)).to(tl.int32)


@triton.jit
def _addr(ptr, ALIGNED: tl.constexpr):
    """An int64 address read from the table; with ALIGNED, declared a multiple of 16 bytes (the host checked),
    so that loads and stores of contiguous runs become 16-byte vector accesses."""
    a = tl.load(ptr)
    if ALIGNED:
        a = tl.multiple_of(a, 16)
    return a


@triton.jit
def _load_float(addr, off, mask, KIND: tl.constexpr):
    """float32 values at int64 address `addr` + `off` of a tensor of PARAM_KINDS kind KIND (0 float32,
    1 bf16, 2 float64); masked lanes read 0."""
    if KIND == 0:
        return tl.load(addr.to(tl.pointer_type(tl.float32)) + off, mask=mask, other=0.0)
    elif KIND == 1:
        return _bf16_load(addr, off, mask)
    else:
        return tl.load(addr.to(tl.pointer_type(tl.float64)) + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mul(x, s, USE_ASM: tl.constexpr):
    """RN(x * s) for a tensor x and a scalar or broadcastable s."""
    return mul_rn(x, tl.zeros_like(x) + s, USE_ASM)


@triton.jit
def _adamw_kernel(table_ptr, tiles_ptr, seeds_ptr, beta1, beta2, omb1, omb2, decay, step_size, inv_bc2_sqrt, eps, clip,
                  FIELDS_: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, GBLOCK: tl.constexpr,
                  GKIND: tl.constexpr, PKIND: tl.constexpr, HAS_MASTER: tl.constexpr, STOCHASTIC: tl.constexpr,
                  USE_ASM: tl.constexpr, ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.load(tiles_ptr + 2 * pid)
    t = tl.load(tiles_ptr + 2 * pid + 1)  # int32 offsets within a parameter: the host checks numel < 2**31
    row = table_ptr + j.to(tl.int64) * FIELDS_
    n = tl.load(row + 8).to(tl.int32)
    if ALIGNED:  # every length a multiple of 16: the tail mask is constant over 16 values (vector accesses)
        n = tl.multiple_of(n, 16)
    b = t * BPP + tl.arange(0, BPP)[:, None]  # [BPP, 1] moment block within the parameter
    off = b * BLOCK + tl.arange(0, BLOCK)[None, :]  # [BPP, BLOCK] value within the parameter
    blive = b < (n + BLOCK - 1) // BLOCK
    live = off < n

    # the gradient, times the clip factor
    if GKIND == 0:
        gc = tl.load(_addr(row + 2, ALIGNED).to(tl.pointer_type(tl.uint8)) + off, mask=live, other=127).to(tl.int32)
        gsp = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        if GBLOCK >= BLOCK:  # one gradient scale per row of the tile: a [BPP, 1] load
            gs = tl.load(gsp + (b * BLOCK) // GBLOCK, mask=blive, other=0.0)
        else:
            gs = tl.load(gsp + off // GBLOCK, mask=live, other=0.0)
        g = mul_rn((gc - 127).to(tl.float32), gs, USE_ASM)
    else:  # dense: GRAD_KINDS 1, 2, 3 are PARAM_KINDS 0, 1, 2
        g = _load_float(_addr(row + 2, ALIGNED), off, live, GKIND - 1)
    g = _mul(g, clip, USE_ASM)

    # the moments: m, and r = sqrt(v)
    mcp = _addr(row + 4, ALIGNED).to(tl.pointer_type(tl.uint8))
    msp = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    rcp = _addr(row + 6, ALIGNED).to(tl.pointer_type(tl.uint8))
    rsp = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    m_old = mul_rn(_fp8_decode(tl.load(mcp + off, mask=blive, other=0).to(tl.int32), USE_ASM),
                   tl.load(msp + b, mask=blive, other=1.0), USE_ASM)
    r_old = mul_rn(_fp8_decode(tl.load(rcp + off, mask=blive, other=0).to(tl.int32), USE_ASM),
                   tl.load(rsp + b, mask=blive, other=1.0), USE_ASM)
    m = _mul(m_old, beta1, USE_ASM) + _mul(g, omb1, USE_ASM)
    v = _mul(mul_rn(r_old, r_old, USE_ASM), beta2, USE_ASM) + _mul(mul_rn(g, g, USE_ASM), omb2, USE_ASM)
    m = tl.where(live, m, 0.0)
    r = tl.where(live, tl.sqrt_rn(v), 0.0)

    # the parameter
    pp = _addr(row + 0, ALIGNED)
    if HAS_MASTER:
        mp = _addr(row + 1, ALIGNED).to(tl.pointer_type(tl.float32))
        p = tl.load(mp + off, mask=live, other=0.0)
    else:
        p = _load_float(pp, off, live, PKIND)
    denom = _mul(r, inv_bc2_sqrt, USE_ASM) + eps
    upd = tl.math.div_rn(_mul(m, step_size, USE_ASM), denom)
    p = _mul(p, decay, USE_ASM) - upd
    if HAS_MASTER:
        tl.store(mp + off, p, mask=live)
    if PKIND == 0:
        tl.store(pp.to(tl.pointer_type(tl.float32)) + off, p, mask=live)
    elif PKIND == 1:
        noise = tl.zeros_like(off).to(tl.int32)
        if STOCHASTIC:
            noise = _noise16(tl.load(seeds_ptr + j), t, BPP, BLOCK)
        tl.store(pp.to(tl.pointer_type(tl.uint16)) + off, _bf16_bits(p, noise, STOCHASTIC).to(tl.uint16), mask=live)
    else:
        tl.store(pp.to(tl.pointer_type(tl.float64)) + off, p.to(tl.float64), mask=live)

    _requantize(m, mcp, msp, off, b, blive, USE_ASM)
    _requantize(r, rcp, rsp, off, b, blive, USE_ASM)


@triton.jit
def _requantize(x, codes_ptr, scales_ptr, off, b, blive, USE_ASM: tl.constexpr):
    """Store x [BPP, BLOCK] as float8 e4m3 codes with scale = block absmax / 448 (1 for an all-zero block):
    codes of RN(x * RN(1 / scale)), one division per block."""
    absmax = tl.reduce(tl.abs(x), 1, nanmax, keep_dims=True)
    s = tl.where(absmax > 0, tl.math.div_rn(absmax, tl.zeros_like(absmax) + 448.0), 1.0)
    inv = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
    q = mul_rn(x, tl.zeros_like(x) + inv, USE_ASM)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(codes_ptr + off, _fp8_encode(q, USE_ASM), mask=blive)
    tl.store(scales_ptr + b, s, mask=blive)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _contiguous(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"adamw_step_triton needs contiguous tensors: {name} is not")
    return t


_DEVICE_TABLES: OrderedDict = OrderedDict()  # least recently used first
_MAX_TABLES = 64


def _on_device(key: tuple, make, device: torch.device) -> torch.Tensor:
    """The device copy of a small host-made table, kept across steps: pointers and sizes of a bucket are usually
    the same every step (QuanGrad's buffer, the state, the parameters), so a step launches its kernel without a
    host-to-device copy. A table is keyed by its whole content, so a stale pointer can never be read. When the
    content changes (gradients the allocator placed elsewhere this step), the new table is copied from pinned
    memory without waiting for the device: a copy from pageable memory would stall the host until the GPU had
    finished all the work queued before it. The least recently used table goes when there are too many."""
    table = _DEVICE_TABLES.get(key)
    if table is not None:
        _DEVICE_TABLES.move_to_end(key)
        return table
    host = make()
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    _DEVICE_TABLES[key] = table
    if len(_DEVICE_TABLES) > _MAX_TABLES:
        _DEVICE_TABLES.popitem(last=False)
    return table


def _tile_map(numels: list[int], per_tile: int, device: torch.device) -> torch.Tensor:
    """int32 [tiles, 2]: (parameter index, tile within the parameter) of every program."""
    counts = torch.tensor([-(-n // per_tile) for n in numels], dtype=torch.int64)
    which = torch.repeat_interleave(torch.arange(len(numels)), counts)
    starts = torch.cumsum(counts, 0) - counts
    tile = torch.arange(int(counts.sum())) - starts[which]
    return torch.stack([which, tile], 1).to(torch.int32).to(device)


def adamw_step_triton(params: list[torch.Tensor], masters: list[torch.Tensor] | None, grads: list,
                      states: list[dict], *, beta1: float, beta2: float, omb1: float, omb2: float, decay: float,
                      step_size: float, inv_bc2_sqrt: float, eps: float, clip: float, block: int, grad_block: int,
                      seeds: list[int] | None) -> None:
    """One launch over a bucket (see the module docstring). All of a bucket's parameters share a dtype and
    its gradients a kind: all (codes, scales) of QuanGrad with values per scale `grad_block`, or all dense
    tensors of one dtype. Scalars are float32 numbers (agoq.runtime.optim.fused_adamw rounds them). `seeds`
    (one int per parameter) selects stochastic rounding of bf16 parameters (only without masters)."""
    if not params:
        return
    if max(p.numel() for p in params) >= 2**31 - 2**16:
        raise ValueError("the fused AdamW step indexes a parameter with 32-bit offsets: split parameters of 2**31 "
                         "values or more")
    pdtype = params[0].dtype
    if pdtype not in PARAM_KINDS:
        raise ValueError(f"the fused AdamW step updates float32, bf16 or float64 parameters, got {pdtype}")
    quant = isinstance(grads[0], tuple)
    gkind = GRAD_KINDS["quangrad" if quant else grads[0].dtype] if quant or grads[0].dtype in GRAD_KINDS else None
    if gkind is None:
        raise ValueError(f"the fused AdamW step reads float32, bf16 or float64 gradients, got {grads[0].dtype}")
    if block & (block - 1) or grad_block & (grad_block - 1):
        raise ValueError(f"the fused AdamW step needs power-of-two blocks, got {block} and {grad_block}")
    rows = []
    for i, (p, g, st) in enumerate(zip(params, grads, states)):
        if p.dtype != pdtype:
            raise ValueError("a bucket's parameters must share one dtype")
        gp, gs = (_ptr(_contiguous("grad codes", g[0])), _ptr(_contiguous("grad scales", g[1]))) if quant \
            else (_ptr(_contiguous("grad", g)), 0)
        rows.append([_ptr(_contiguous("param", p)), _ptr(masters[i]) if masters is not None else 0, gp, gs,
                     _ptr(_contiguous("exp_avg_codes", st["exp_avg_codes"])), _ptr(st["exp_avg_scales"]),
                     _ptr(_contiguous("exp_avg_sqrt_codes", st["exp_avg_sqrt_codes"])),
                     _ptr(st["exp_avg_sqrt_scales"]), p.numel()])
    device = params[0].device
    # 16-byte aligned addresses (param, master, grad or grad codes, moment codes) and lengths a multiple of 16
    aligned = all(r[k] % 16 == 0 for r in rows for k in (0, 1, 2, 4, 6)) and all(r[8] % 16 == 0 for r in rows)
    table = _on_device(("table", device, tuple(map(tuple, rows))), lambda: torch.tensor(rows, dtype=torch.int64),
                       device)
    stochastic = seeds is not None and masters is None and pdtype == torch.bfloat16
    # the seeds change every step: their own small tensor, copied from pinned memory without a host sync (the
    # table, whose content is the same every step, stays on the device); without stochastic rounding the kernel
    # reads no seed, and the table stands in for the pointer (no copy at all)
    seeds_dev = table
    if stochastic:
        host = torch.tensor(seeds, dtype=torch.int64)
        seeds_dev = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    numels = tuple(p.numel() for p in params)
    tiles = _on_device(("tiles", device, block, numels),
                       lambda: _tile_map(list(numels), block * BLOCKS_PER_PROGRAM, torch.device("cpu")), device)
    _adamw_kernel[(tiles.shape[0],)](
        table, tiles, seeds_dev, beta1, beta2, omb1, omb2, decay, step_size, inv_bc2_sqrt, eps, clip,
        FIELDS_=FIELDS, BLOCK=block, BPP=BLOCKS_PER_PROGRAM, GBLOCK=grad_block, GKIND=gkind,
        PKIND=PARAM_KINDS[pdtype], HAS_MASTER=masters is not None,
        STOCHASTIC=stochastic, USE_ASM=USE_ASM,
        ALIGNED=aligned, num_warps=NUM_WARPS)


# ------------------------------------------------------------------------------------ gradient norm


@triton.jit
def _codes_sq_kernel(codes_ptr, scales_ptr, out_ptr, nblocks, BLOCK: tl.constexpr, BPP: tl.constexpr):
    """out[pid] = sum over its BPP blocks of scale**2 * sum((code - 127)**2): integer sums, float64 products."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid * BPP + tl.arange(0, BPP)
    live = b < nblocks
    c = tl.load(codes_ptr + b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], mask=live[:, None],
                other=127).to(tl.int32) - 127
    ints = tl.sum(c * c, axis=1)  # <= 256 * 127**2: exact in int32
    s = tl.load(scales_ptr + b, mask=live, other=0.0).to(tl.float64)
    tl.store(out_ptr + pid, tl.sum(ints.to(tl.float64) * s * s, axis=0))


@triton.jit
def _dense_sq_kernel(table_ptr, tiles_ptr, out_ptr, TILE: tl.constexpr, KIND: tl.constexpr):
    """out[pid] = sum of squares (float32 products, float64 total) over one tile of one tensor."""
    pid = tl.program_id(0)
    j = tl.load(tiles_ptr + 2 * pid).to(tl.int64)
    t = tl.load(tiles_ptr + 2 * pid + 1).to(tl.int64)
    ptr = tl.load(table_ptr + 2 * j)
    n = tl.load(table_ptr + 2 * j + 1)
    off = t * TILE + tl.arange(0, TILE)
    live = off < n
    g = _load_float(ptr, off, live, KIND - 1).to(tl.float64)  # GRAD_KINDS 1, 2, 3 = PARAM_KINDS 0, 1, 2
    tl.store(out_ptr + pid, tl.sum(g * g, axis=0))


def codes_norm_sq_triton(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Sum of squares (float64 0-d tensor) of a whole QuanGrad buffer (zero codes are 127): one launch."""
    nblocks = scales.numel()
    bpp = 16
    programs = triton.cdiv(nblocks, bpp)
    out = torch.empty(max(programs, 1), dtype=torch.float64, device=codes.device)
    if programs == 0:
        return out.zero_().sum()
    _codes_sq_kernel[(programs,)](codes, scales, out, nblocks, BLOCK=block, BPP=bpp, num_warps=4)
    return out.sum()


def dense_norm_sq_triton(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares (float64 0-d tensor) of dense gradients: one launch per dtype."""
    device = grads[0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        if g.dtype not in GRAD_KINDS:
            raise ValueError(f"grad_norm_sq reads float32, bf16 or float64 gradients, got {g.dtype}")
        by_dtype.setdefault(g.dtype, []).append(_contiguous("grad", g))
    for dtype, group in by_dtype.items():
        rows = tuple((g.data_ptr(), g.numel()) for g in group)
        table = _on_device(("norm", device, rows), lambda: torch.tensor(rows, dtype=torch.int64), device)
        numels = tuple(n for _, n in rows)
        tiles = _on_device(("norm tiles", device, numels),
                           lambda: _tile_map(list(numels), NORM_TILE, torch.device("cpu")), device)
        out = torch.empty(tiles.shape[0], dtype=torch.float64, device=device)
        if tiles.shape[0]:
            _dense_sq_kernel[(tiles.shape[0],)](table, tiles, out, TILE=NORM_TILE, KIND=GRAD_KINDS[dtype], num_warps=8)
        total += out.sum()
    return total
