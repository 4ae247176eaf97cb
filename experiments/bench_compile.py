"""agoq under torch.compile against torch.compile's own memory savers: one fwd+bwd step of a LLaMA model per variant.

A variant is "MODE-KIND": MODE `eager` or `compiled`; KIND one of
  bf16          the model as it is
  budgetB       bf16 with torch._functorch.config.activation_memory_budget = B (compiled only), e.g. budget0.3
  checkpoint    every decoder layer checkpointed (torch.utils.checkpoint)
  fused-bf16    every layer through agoq's fused functions, every kind kept at 16 bits
  PRESET[:FMT[:BLOCK]]  an agoq activation policy (agoq-paper, int8, int4, ...), e.g. agoq-paper:nf4:64
Compiled variants compile each decoder layer on its own (agoq.runtime.activations.compile, as torchtitan does; the
embedding, final norm and chunked loss stay eager in every variant), or the whole model with --whole.

For each: step time (median of CUDA-event-timed fwd+bwd steps after --warmup untimed ones; grads set to None
before each), peak memory above weights (max allocated during the step minus allocated before it), compile
time (wall time of the first step minus the median step), and both as ratios against compiled-bf16.

    python experiments/bench_compile.py [--layers 16] [--variants ...] [--whole] [--mode reduce-overhead]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agoq  # noqa: E402
from agoq.runtime.activations.checkpointing import apply_checkpointing, remove_checkpointing  # noqa: E402
from agoq.runtime.activations.compile import compile_decoder_layers, mark_cudagraph_step  # noqa: E402
from agoq.runtime.activations.saved_bytes import find_decoder_layers  # noqa: E402
from agoq.models import build  # noqa: E402
from experiments.bench_laaq import force_fused_keep, variant_policy  # noqa: E402
from experiments.record import write_result  # noqa: E402

GiB = 2**30
DEFAULT_VARIANTS = ("eager-bf16,compiled-bf16,compiled-budget0.5,compiled-budget0.3,compiled-budget0.1,"
                    "compiled-checkpoint,compiled-fused-bf16,compiled-agoq-paper,compiled-int8,compiled-int4")


def reset(model) -> None:
    """Back to the plain eager model: no policy, no checkpointing, no compiled layers, no Dynamo caches."""
    agoq.remove_activation_policy(model)
    remove_checkpointing(model)
    for layer in find_decoder_layers(model):
        layer._compiled_call_impl = None
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = 1.0


def set_variant(model, name: str, whole: bool, backend: str, mode: str = "default"):
    """Configure `model` for a variant; returns the callable that runs one forward (ids, labels) -> loss."""
    where, kind = name.split("-", 1)
    if where not in ("eager", "compiled"):
        raise ValueError(f"variant {name!r}: give eager-KIND or compiled-KIND")
    if kind.startswith("budget"):
        if where != "compiled":
            raise ValueError(f"{name}: activation_memory_budget is a torch.compile setting")
        torch._functorch.config.activation_memory_budget = float(kind[len("budget"):])
    elif kind == "checkpoint":
        apply_checkpointing(model)
    elif kind == "fused-bf16":
        force_fused_keep(model)
    elif kind != "bf16":
        agoq.apply_activation_policy(model, variant_policy(kind))
    if where == "eager":
        return model
    options = {} if mode == "default" else {"mode": mode}
    if whole:
        return torch.compile(model, backend=backend, **options)
    compile_decoder_layers(model, backend=backend, **options)
    return model


def measure(fn, model, ids, labels, warmup: int, steps: int, mode: str = "default"):
    """(first step's wall seconds, timed step ms, peak bytes above what was allocated before each timed step);
    on the CPU (a smoke run) wall-clock times and no memory figures."""
    times, peaks, first = [], [], None
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        mark_cudagraph_step(mode)
        if not ids.is_cuda:
            t0 = time.perf_counter()
            fn(ids, labels).backward()
            first = first or time.perf_counter() - t0
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
                peaks.append(0)
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn(ids, labels).backward()
        end.record()
        torch.cuda.synchronize()
        if i == 0:
            first = time.perf_counter() - t0
        if i >= warmup:
            times.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated() - before)
    return first, times, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="probe")
    parser.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps, the first one compiling")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated (see the module docstring)")
    parser.add_argument("--whole", action="store_true", help="torch.compile the whole model instead of each layer")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager for a CPU smoke run)")
    parser.add_argument("--mode", default="default",
                        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"),
                        help="torch.compile mode of the compiled variants (reduce-overhead: CUDA graphs; refused for "
                             "stochastic-rounding policies, whose host-drawn seeds a graph would freeze)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no memory figures)")
    parser.add_argument("--name", default="bench_compile")
    parser.add_argument("--out", default=None, help="also write the result JSON into this folder")
    args = parser.parse_args()
    dev = args.device
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build(args.model, dtype=torch.bfloat16, device=dev, num_layers=args.layers)
    cfg = model.config
    g = torch.Generator(device=dev).manual_seed(1234)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)
    labels = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)
    weights = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0

    results = {}
    for name in args.variants.split(","):
        reset(model)
        t0 = time.perf_counter()
        try:
            fn = set_variant(model, name, args.whole, args.backend, args.mode)
            first, times, peaks = measure(fn, model, ids, labels, args.warmup, args.steps,
                                          args.mode if name.startswith("compiled") else "default")
        except Exception as exc:  # one variant failing (e.g. out of memory) must not lose the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            model.zero_grad(set_to_none=True)
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        step = statistics.median(times)
        row = {"step_ms": step, "step_ms_all": times, "memory_above_weights_GiB": max(peaks) / GiB,
               "first_step_s": first, "compile_s": max(0.0, first - step / 1e3) if name.startswith("compiled") else 0.0,
               "variant_wall_s": time.perf_counter() - t0}
        results[name] = row
        print(f"{name:28s} step {step:7.1f} ms  above weights {row['memory_above_weights_GiB']:6.2f} GiB  "
              f"compile {row['compile_s']:5.1f} s", flush=True)
    reset(model)

    base = results.get("compiled-bf16")
    if base and "step_ms" in base:
        for row in results.values():
            if "step_ms" in row:
                row["step_vs_compiled_bf16"] = row["step_ms"] / base["step_ms"]
                if base["memory_above_weights_GiB"]:
                    row["memory_vs_compiled_bf16"] = row["memory_above_weights_GiB"] / base["memory_above_weights_GiB"]
    print(f"\n{'variant':28s} {'step ms':>8s} {'x cbf16':>8s} {'GiB':>6s} {'x cbf16':>8s} {'compile s':>9s}")
    for name, row in results.items():
        if "error" in row:
            print(f"{name:28s} failed: {row['error'][:100]}")
            continue
        print(f"{name:28s} {row['step_ms']:8.1f} {row.get('step_vs_compiled_bf16', float('nan')):8.3f} "
              f"{row['memory_above_weights_GiB']:6.2f} {row.get('memory_vs_compiled_bf16', float('nan')):8.3f} "
              f"{row['compile_s']:9.1f}")
    figures = {"model": args.model, "layers": cfg.num_hidden_layers, "batch": args.batch, "seq": args.seq,
               "compile": "whole model" if args.whole else "per decoder layer", "backend": args.backend, "mode": args.mode,
               "weights_GiB": weights / GiB, "steps": args.steps, "warmup": args.warmup, "variants": results}
    print("wrote", write_result(args.name, figures, args.out))


if __name__ == "__main__":
    main()
