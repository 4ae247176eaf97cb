"""Quantize / dequantize kernel bandwidth on one GPU, against a device-to-device copy.

Bandwidth counts bytes read + bytes written (input values, packed codes, scales), like the copy.
Also checks, on the GPU, that the kernels give the reference's bytes on fresh random data.

    python experiments/bench_kernels.py [--mib 512] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.runtime.quant import block_triton as quant_triton  # noqa: E402
from agoq.runtime.quant.qtensor import quantized_nbytes  # noqa: E402
from agoq.runtime.quant.codec import dequantize, quantize  # noqa: E402
from experiments.record import write_result  # noqa: E402


def bench(fn) -> float:
    """Median milliseconds of fn over repeated timed runs (device events)."""
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def check_against_reference() -> list[str]:
    failures = []
    for bits in range(2, 9):
        for fmt in ("int", "nf4") if bits == 4 else ("int",):
            x = torch.randn(7, 100_003, device="cuda", dtype=torch.bfloat16) * 3.1
            a = quantize(x, bits, 128, format=fmt, backend="triton")
            b = quantize(x.cpu(), bits, 128, format=fmt, backend="torch")
            if not (torch.equal(a.data.cpu(), b.data) and torch.equal(a.scales.cpu(), b.scales)):
                failures.append(f"quantize bits={bits} fmt={fmt}")
            back = dequantize(a, torch.float32, backend="triton").cpu()
            ref = dequantize(b, torch.float32, backend="torch")
            if not torch.equal(back, ref):
                failures.append(f"dequantize bits={bits} fmt={fmt}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="input tensor size in MiB of bf16 (default 512)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--variants", action="store_true", help="also sweep tile sizes and warps")
    args = parser.parse_args()

    failures = check_against_reference()
    print("reference check:", "OK" if not failures else failures, flush=True)

    n = args.mib * 2**20 // 2
    xs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dst = torch.empty_like(xs[0])
    copy_ms = bench(lambda: dst.copy_(xs[0]))
    copy_gbs = 2 * n * 2 / copy_ms / 1e6
    print(f"copy: {copy_ms:.3f} ms  {copy_gbs:.0f} GB/s", flush=True)

    configs = [(b, "int", "nearest") for b in (2, 3, 4, 5, 6, 7, 8)]
    configs += [(4, "nf4", "nearest"), (4, "int", "stochastic"), (8, "int", "stochastic")]
    variants = [(quant_triton.TILE_VALUES, quant_triton.NUM_WARPS)]
    if args.variants:
        variants += [(1024, 4), (2048, 8), (4096, 8), (4096, 4), (8192, 8)]
    rows = []
    for tile, warps in variants:
        quant_triton.TILE_VALUES, quant_triton.NUM_WARPS = tile, warps
        for bits, fmt, rounding in configs:
            q = quantize(xs[0], bits, 128, rounding=rounding, format=fmt, seed=1 if rounding == "stochastic" else None,
                         check_finite=False)
            out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
            i = [0]

            def run_q():
                i[0] ^= 1
                quant_triton.quantize_triton(xs[i[0]], bits, 128, fmt, 1 if rounding == "stochastic" else None)

            q_ms = bench(run_q)
            d_ms = bench(lambda: quant_triton.dequantize_triton(q.data, q.scales, bits, 128, n, fmt,
                                                                 torch.bfloat16, out=out))
            moved = n * 2 + quantized_nbytes(n, bits, 128)
            row = {
                "bits": bits, "format": fmt, "rounding": rounding, "block": 128, "tile": tile, "warps": warps,
                "numel": n, "bytes_moved": moved,
                "quantize_ms": q_ms, "quantize_GBps": moved / q_ms / 1e6,
                "dequantize_ms": d_ms, "dequantize_GBps": moved / d_ms / 1e6,
            }
            row["quantize_vs_copy"] = row["quantize_GBps"] / copy_gbs
            row["dequantize_vs_copy"] = row["dequantize_GBps"] / copy_gbs
            rows.append(row)
            print(f"tile {tile:5d} w{warps} bits {bits} {fmt:3s} {rounding:10s} "
                  f"quant {row['quantize_GBps']:5.0f} GB/s ({row['quantize_vs_copy']:.0%})  "
                  f"dequant {row['dequantize_GBps']:5.0f} GB/s ({row['dequantize_vs_copy']:.0%})", flush=True)
    path = write_result("kernels", {"input_MiB": args.mib, "copy_ms": copy_ms, "copy_GBps": copy_gbs,
                                    "reference_check_failures": failures, "rows": rows}, args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
