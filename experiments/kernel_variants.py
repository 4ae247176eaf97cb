"""Quantize / dequantize kernels on one GPU: byte checks against the reference, then bandwidth per
setting, against a device-to-device copy (bytes read + written, as in bench_kernels.py).

    python experiments/kernel_variants.py [--mib 512] [--variants 2048x4,2048x4:p10:c32:g,4096x4]
                                          [--configs all|4i,5i,4n,4s,...] [--skip-check]

A variant is TILE_VALUESxNUM_WARPS[:flag...] (quant_triton's knobs; quantize uses min(NUM_WARPS,
TILE_VALUES / 1024) warps). Flags: d (odd widths: all words stored directly), g (odd widths: all
words through shared memory), cN (NF4_CELLS = N), pN (PHILOX_ROUNDS = N). A variant with flags only
runs the formats its flags touch. Config codes: <bits> + i (int nearest), n (nf4 nearest),
s (int stochastic), m (nf4 stochastic).

Checks (fresh random data every run): packed bytes, scales and dequantized values (float32 and bf16)
equal the torch reference for bits 2..8 and nf4 on bf16 input * 3.1, on odd sizes, and on edge blocks
(zeros, constants, exact rounding ties, huge, tiny, subnormal, inf/NaN); stochastic rounding stays
between floor and ceil and its mean error shrinks with the number of seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.runtime.quant import block_triton as qt  # noqa: E402
from agoq.runtime.quant import reference as ref  # noqa: E402
from agoq.runtime.quant.qtensor import int_qmax, quantized_nbytes  # noqa: E402

FORMATS = [(b, "int") for b in range(2, 9)] + [(4, "nf4")]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def edge_data(block: int, gen: torch.Generator) -> torch.Tensor:
    def rn(k, s=1.0):
        return torch.randn(k, generator=gen) * s
    huge = (torch.rand(block, generator=gen) * 2 - 1) * 3.4e38  # finite; 1/scale is subnormal
    parts = [torch.zeros(block), torch.full((block,), -2.75), rn(block, 1e37), rn(block, 3e38), huge, rn(block, 1e-30),
             rn(block, 1e-41), rn(block, 1e-44), rn(block), rn(block)]
    p = rn(block); p[5] = float("nan"); parts.append(p)
    p = rn(block); p[3] = float("inf"); parts.append(p)
    p = rn(block); p[7] = -float("inf"); p[8] = float("nan"); parts.append(p)
    for qmax in (1, 3, 7, 15, 31, 63, 127):  # v = x / scale lands exactly on k + 1/2
        k = torch.randint(-qmax, qmax, (block,), generator=gen).float() + 0.5
        k[0] = qmax
        parts.append(k * 0.125)
    parts.append(rn(37))
    return torch.cat(parts)


def check(device: str, light: bool = False) -> list[str]:
    fails = []
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    inputs = [("randn bf16*3.1 700k", (torch.randn(7 * 100_003, generator=gen) * 3.1).to(torch.bfloat16), 128)]
    inputs.append(("edge bf16 block=128", edge_data(128, gen).to(torch.bfloat16), 128))
    if not light:
        for n in (1, 31, 4096 * 3 + 37, 8192 * 2 + 5, 100_000):
            inputs.append((f"randn f32 n={n}", torch.randn(n, generator=gen) * 2.0, 32))
            inputs.append((f"randn f16 n={n}", (torch.randn(n, generator=gen)).to(torch.float16), 512))
        for block in (32, 128, 4096):
            inputs.append((f"edge block={block}", edge_data(block, gen), block))
    for name, x, block in inputs:
        for bits, fmt in FORMATS:
            d_ref, s_ref = ref.quantize_reference(x, bits, block, fmt)
            d, s = qt.quantize_triton(x.to(device), bits, block, fmt)
            if not (same(d, d_ref) and same(s, s_ref)):
                bad = (d.cpu() != d_ref).nonzero().flatten()[:4].tolist() if d.numel() == d_ref.numel() else "size"
                fails.append(f"quantize {name} bits={bits} {fmt}: bytes {same(d, d_ref)} scales {same(s, s_ref)} {bad}")
                continue
            for dt in (torch.float32, torch.bfloat16):
                back_ref = ref.dequantize_reference(d_ref, s_ref, bits, block, x.numel(), fmt, dt)
                back = qt.dequantize_triton(d, s, bits, block, x.numel(), fmt, dt)
                if not same(back, back_ref):
                    fails.append(f"dequantize {name} bits={bits} {fmt} -> {dt}")
    # stochastic: floor/ceil, unbiased (mean over seeds approaches x)
    x = torch.randn(4099, generator=gen).to(device)
    stochastic = [(4, "int"), (4, "nf4")] if light else [(2, "int"), (4, "int"), (5, "int"), (8, "int"), (4, "nf4")]
    for bits, fmt in stochastic:
        outs = []
        for seed in range(64):
            d, s = qt.quantize_triton(x, bits, 32, fmt, seed=1000 + seed)
            outs.append(qt.dequantize_triton(d, s, bits, 32, x.numel(), fmt, torch.float64))
        st = torch.stack(outs)
        d, s = qt.quantize_triton(x, bits, 32, fmt)
        nearest = qt.dequantize_triton(d, s, bits, 32, x.numel(), fmt, torch.float64)
        b8 = (st[:8].mean(0) - x.double()).abs().mean().item()
        b64 = (st.mean(0) - x.double()).abs().mean().item()
        en = (nearest - x.double()).abs().mean().item()
        if fmt == "int":
            scale = s.double().repeat_interleave(32)[: x.numel()]
            v = x.double() / scale
            q = int_qmax(bits)
            lo, hi = torch.floor(v).clamp(-q, q), torch.ceil(v).clamp(-q, q)
            c = st / scale
            tol = 1e-6 * (1 + c.abs())
            if not ((c - lo).abs().le(tol) | (c - hi).abs().le(tol)).all():
                fails.append(f"stochastic bits={bits}: code outside floor/ceil")
        ok = b64 < b8 * 0.6 and (b64 < en or bits == 8)
        print(f"  stochastic bits={bits} {fmt}: mean |bias| 8 seeds {b8:.3g}, 64 seeds {b64:.3g}, nearest {en:.3g}"
              f" {'ok' if ok else 'BAD'}", flush=True)
        if not ok:
            fails.append(f"stochastic bits={bits} {fmt}: bias")
    return fails


DEFAULTS = dict(ODD_GATHER_BITS=qt.ODD_GATHER_BITS, PHILOX_ROUNDS=qt.PHILOX_ROUNDS, NF4_CELLS=qt.NF4_CELLS,
                TILE_VALUES=qt.TILE_VALUES, NUM_WARPS=qt.NUM_WARPS)


def set_variant(v: str) -> set:
    """Apply a variant's knobs; returns the set of format codes it concerns (empty: all)."""
    for k, val in DEFAULTS.items():
        setattr(qt, k, val)
    tw, *flags = v.split(":")
    qt.TILE_VALUES, qt.NUM_WARPS = map(int, tw.split("x"))
    only = set()
    for f in flags:
        if f == "d":
            qt.ODD_GATHER_BITS = ()
            only |= {"3i", "5i", "6i", "7i"}
        elif f == "g":
            qt.ODD_GATHER_BITS = (3, 5, 6, 7)
            only |= {"3i", "5i", "6i", "7i"}
        elif f.startswith("c"):
            qt.NF4_CELLS = int(f[1:])
            only |= {"4n"}
        elif f.startswith("p"):
            qt.PHILOX_ROUNDS = int(f[1:])
            only |= {"4s", "8s", "4m"}
    return only


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--variants", default="2048x4,2048x4:p10:c32:g,4096x4", help="TILE_VALUESxNUM_WARPS list")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--configs", default="all", help="'all' or e.g. 4i,5i,4n,4s")
    args = parser.parse_args()
    device = "cuda"
    t0 = time.time()
    print("gpu:", torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    if not args.skip_check:
        fails = []
        for k, v in enumerate(args.variants.split(",")):
            set_variant(v)
            f = check(device, light=k > 0)
            fails += [f"[{v}] {m}" for m in f]
            print(f"check {v}: {'OK' if not f else f'{len(f)} failures'} ({time.time() - t0:.0f}s)", flush=True)
        set_variant(args.variants.split(",")[0])
        for m in fails[:40]:
            print("  FAIL", m)

    n = args.mib * 2**20 // 2
    xs = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    dst = torch.empty_like(xs[0])
    copy_ms = bench(lambda: dst.copy_(xs[0]))
    copy_gbs = 2 * n * 2 / copy_ms / 1e6
    print(f"copy: {copy_ms:.3f} ms {copy_gbs:.0f} GB/s  ({time.time() - t0:.0f}s)", flush=True)
    configs = [(b, "int", "nearest") for b in range(2, 9)] + [(4, "nf4", "nearest"), (4, "int", "stochastic"),
                                                               (8, "int", "stochastic"), (4, "nf4", "stochastic")]
    if args.configs != "all":
        want = args.configs.split(",")
        letters = {"i": ("int", "nearest"), "n": ("nf4", "nearest"), "s": ("int", "stochastic"),
                   "m": ("nf4", "stochastic")}
        configs = [(int(w[:-1]),) + letters[w[-1]] for w in want]
    rows = []
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    code = {("int", "nearest"): "i", ("nf4", "nearest"): "n", ("int", "stochastic"): "s", ("nf4", "stochastic"): "m"}
    for v in args.variants.split(","):
        only = set_variant(v)
        for bits, fmt, rounding in configs:
            if only and f"{bits}{code[fmt, rounding]}" not in only:
                continue
            seed = 1 if rounding == "stochastic" else None
            d, s = qt.quantize_triton(xs[0], bits, 128, fmt, seed)
            i = [0]

            def run_q():
                i[0] ^= 1
                qt.quantize_triton(xs[i[0]], bits, 128, fmt, seed)

            q_ms = bench(run_q)
            d_ms = bench(lambda: qt.dequantize_triton(d, s, bits, 128, n, fmt, torch.bfloat16, out=out))
            moved = n * 2 + quantized_nbytes(n, bits, 128)
            row = dict(variant=v, bits=bits, fmt=fmt, rounding=rounding, q_ms=q_ms, d_ms=d_ms,
                       q_gbs=moved / q_ms / 1e6, d_gbs=moved / d_ms / 1e6)
            row["q_vs_copy"], row["d_vs_copy"] = row["q_gbs"] / copy_gbs, row["d_gbs"] / copy_gbs
            rows.append(row)
            print(f"{v:>7} bits {bits} {fmt} {rounding:10s} quant {row['q_gbs']:5.0f} GB/s ({row['q_vs_copy']:4.0%})"
                  f"  dequant {row['d_gbs']:5.0f} GB/s ({row['d_vs_copy']:4.0%})", flush=True)
    print(f"total {time.time() - t0:.0f}s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernel_variants.json").write_text(
            json.dumps({"copy_gbs": copy_gbs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
