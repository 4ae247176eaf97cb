"""The optimizer step alone on one GPU: time, peak memory and bandwidth for 1 B and 8 B parameters.

Parameters are a list of bf16 tensors of LLaMA shapes (LLaMA-3.2-1B-like and LLaMA-3-8B: embedding, per
layer q/k/v/o, gate/up/down and two norms, final norm, LM head), not one giant tensor. Variants:

  torch_fused   torch.optim.AdamW(fused=True) on float32 masters with float32 moments (grads float32)
  old_8bit      the previous AdamW8bit path: QuanGrad.to_grads() float32 gradients, masters, dequantize-all
                (emulated: MasterWeights + AdamW8bit with the fused step is no longer the old path, so this
                variant dequantizes every gradient to float32 first and steps float32 masters)
  fused_dense   FusedAdamW8bit, masters, dense bf16 .grad
  fused_quangrad FusedAdamW8bit, masters, reading QuanGrad's 8-bit codes in place
  fused_nomaster FusedAdamW8bit without masters (stochastic rounding), QuanGrad gradients
  torchao / bnb  torchao.optim.AdamW8bit and bitsandbytes.optim.AdamW8bit on bf16 params (skipped, with a
                note, when not importable)

Bytes the fused step must move per value (counted, not measured):
  gradient        1 (QuanGrad code) + 4/256 (its scale)        | dense bf16: 2
  two moments     2 x (1 code + 4/256 scale) read and written   = 2 x 2 x 1.015625
  master          4 read + 4 write                              (none without masters)
  bf16 parameter  2 write (+ 2 read without masters)
  fused_quangrad: 1.015625 + 4.0625 + 8 + 2 = 15.08 B/value; fused_dense 16.06; fused_nomaster 9.08.
Bandwidth = bytes / median time, reported beside a measured device-to-device copy (read + write).

  python experiments/bench_optim_step.py                 # --sizes 1b,8b (about 3 minutes on an H200)
  python experiments/bench_optim_step.py --sizes 1b --iters 10
Writes experiments/results/optim_step.json (experiments/record.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoq.runtime.comm.quangrad import QuantizedGradients  # noqa: E402
from agoq.runtime.optim.adamw8bit import AdamW8bit, FusedAdamW8bit  # noqa: E402
from agoq.runtime.optim import fused_adamw_triton  # noqa: E402
from agoq.runtime.optim.fused_adamw import grad_norm_sq  # noqa: E402
from experiments.record import write_result  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# (hidden, intermediate, layers, vocab, kv heads x head dim)
MODELS = {"1b": (2048, 8192, 16, 128256, 512), "8b": (4096, 14336, 32, 128256, 1024)}
GRAD_SCALE_BYTES = 4 / 256


def shapes(name: str) -> list[tuple[int, ...]]:
    h, f, layers, vocab, kv = MODELS[name]
    out = [(vocab, h)]
    for _ in range(layers):
        out += [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    return out + [(h,), (vocab, h)]


def bytes_per_value(variant: str) -> float:
    grad = 1 + GRAD_SCALE_BYTES if variant in ("fused_quangrad", "fused_nomaster") else 2
    moments = 2 * 2 * (1 + 4 / 256)
    master = 8 if variant != "fused_nomaster" else 0
    param = 2 if variant != "fused_nomaster" else 4
    return grad + moments + master + param


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2**31) -> float:
    """GB/s of a device-to-device copy (bytes read + written)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), 3, 10)
    del x, y
    return 2 * nbytes / ms / 1e6


def make_params(name: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02)
            for s in shapes(name)]


def run_variant(variant: str, name: str, warmup: int, iters: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    params = make_params(name)
    n = sum(p.numel() for p in params)
    qg = None
    if variant in ("fused_quangrad", "fused_nomaster", "old_8bit"):
        qg = QuantizedGradients(params, capture=False)
        for p in params:  # a gradient in every block
            qg.add_(p, torch.randn_like(p) * 1e-3)
    else:
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
    if variant == "torch_fused":
        masters = [p.detach().float() for p in params]
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        opt = torch.optim.AdamW(masters, **HP, fused=True)

        def step():
            opt.step()
            for p, m in zip(params, masters):
                p.data.copy_(m)
    elif variant == "old_8bit":
        masters = [p.detach().float().requires_grad_(True) for p in params]
        opt = AdamW8bit(masters, **HP)

        def step():
            grads = [qg.gradient(p) for p in params]  # every gradient dequantized to float32 at once, as before
            for m, g in zip(masters, grads):
                m.grad = g
            del grads
            opt.step()
            for p, m in zip(params, masters):
                p.data.copy_(m)
                m.grad = None
    elif variant in ("fused_dense", "fused_quangrad", "fused_nomaster"):
        opt = FusedAdamW8bit(params, **HP, masters=variant != "fused_nomaster")

        def step():
            sq = grad_norm_sq(qg if qg is not None else [p.grad for p in params])
            opt.step(grads=qg, clip_scale=1.0 / max(1.0, float(sq.sqrt())))
    elif variant == "torchao":
        from torchao.optim import AdamW8bit as AoAdamW8bit

        opt = AoAdamW8bit(params, **HP)
        step = opt.step
    elif variant == "bnb":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(params, **HP)
        step = opt.step
    else:
        raise ValueError(variant)
    step()  # state allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, warmup, iters)
    peak = torch.cuda.max_memory_allocated()
    out = {"variant": variant, "model": name, "parameters": n, "median_ms": ms, "peak_bytes": peak}
    if variant.startswith("fused"):
        moved = bytes_per_value(variant) * n
        out.update(bytes_moved=moved, gb_per_s=moved / ms / 1e6)
    del opt, params, qg
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1b,8b", help="comma-separated: 1b, 8b (default both)")
    ap.add_argument("--variants", default="torch_fused,old_8bit,fused_dense,fused_quangrad,fused_nomaster,torchao,bnb")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep", action="store_true",
                    help="only time fused_quangrad and fused_nomaster at 1b for each blocks-per-program x warps "
                         "(the kernel's launch shape), print the table, write optim_step_sweep.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_optim_step needs a CUDA GPU")
    copy = copy_bandwidth()
    if args.sweep:
        rows = []
        for bpp in (2, 4, 8, 16):
            for warps in (4, 8):
                fused_adamw_triton.BLOCKS_PER_PROGRAM, fused_adamw_triton.NUM_WARPS = bpp, warps
                for variant in ("fused_quangrad", "fused_nomaster"):
                    r = run_variant(variant, "1b", args.warmup, args.iters)
                    r.update(blocks_per_program=bpp, num_warps=warps, fraction_of_copy=r["gb_per_s"] / copy)
                    rows.append(r)
                    print(f"bpp {bpp:2d} warps {warps} {variant:>15s} {r['median_ms']:8.2f} ms "
                          f"{r['fraction_of_copy']:.0%} of copy", flush=True)
        print("wrote", write_result("optim_step_sweep", {"copy_gb_per_s": copy, "results": rows}))
        return
    results, notes = [], []
    for name in args.sizes.split(","):
        for variant in args.variants.split(","):
            try:
                r = run_variant(variant, name, args.warmup, args.iters)
            except ImportError as e:
                notes.append(f"{variant}: skipped, not importable ({e})")
                continue
            except torch.cuda.OutOfMemoryError:
                notes.append(f"{variant} {name}: out of memory")
                gc.collect()
                torch.cuda.empty_cache()
                continue
            if "gb_per_s" in r:
                r["fraction_of_copy"] = r["gb_per_s"] / copy
            results.append(r)
            print(r, flush=True)
    path = write_result("optim_step", {"copy_gb_per_s": copy, "results": results, "notes": notes,
                                       "bytes_per_value": {v: bytes_per_value(v) for v in
                                                           ("fused_dense", "fused_quangrad", "fused_nomaster")}})
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    main()
