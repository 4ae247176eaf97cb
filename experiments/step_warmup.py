"""How a fresh training process's step time settles: every step's seconds of `agoq train`'s step (measure_steps), each
variant in a process of its own, with the host's load average sampled beside it.

The run gets an Inductor cache of its own (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in a fresh folder), so the
first compiled variant compiles from nothing and later ones find its graphs in the cache.

Variants (--variants, comma-separated):
  compiled           compiled bf16 + the optimizer (--optimizer), as agoq train runs it (named twice: the second run
                     finds its graphs in Inductor's cache)
  compiled-1thread   the same with TORCHINDUCTOR_COMPILE_THREADS=1 (Inductor compiles in this process: no worker pool)
  compiled-warm      the same after Inductor's worker pool was started and answered (AsyncCompile.warm_pool,
                     wait_pool_ready) and WARM_SECONDS more seconds passed, before the model is built
  compiled-no-fx-cache      the same with Inductor's FX graph cache and AOTAutograd's cache off (graphs compiled
                            again; Triton's kernel binaries may still come from the cache)
  compiled-triton-launcher  the same with TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 (Triton's own launcher)
  compiled-static-launcher  the same with TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=1
  compiled-no-bundle        the same with TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE=0
  eager              eager bf16 + the optimizer

--profile-steps N runs N more steps under torch.profiler after the timed ones and records the host's busiest
operations and the kernels' GPU time per step, so a slow variant can be read against a fast one.

GPU (one H200, about 2 minutes):
  python experiments/step_warmup.py --model probe --micro-batch 2 --seq-len 4096 --steps 40
Writes experiments/results/NAME.json (--name, default step_warmup).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WARM_SECONDS = 10.0
ENVIRONMENTS = {"compiled-1thread": {"TORCHINDUCTOR_COMPILE_THREADS": "1"},
                "compiled-no-fx-cache": {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"},
                "compiled-triton-launcher": {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "0"},
                "compiled-static-launcher": {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "1"},
                "compiled-no-bundle": {"TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE": "0"}}


def profiled(trainer, first_step: int, steps: int) -> dict:
    """`steps` more steps under torch.profiler: the kernels' GPU time per step and the host's busiest operations."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for step in range(first_step, first_step + steps):
            trainer.step(step)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / steps / 1e3
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
    return {"profiled_step_ms": wall * 1e3, "kernel_ms_per_step": gpu,
            "host_top": [{"name": e.key[:120], "self_cpu_ms_per_step": e.self_cpu_time_total / steps / 1e3,
                          "calls_per_step": e.count / steps} for e in host]}


def one(args) -> dict:
    """One variant in this process: per-step seconds and the load average every half second."""
    import torch

    from agoq.train.config import TrainConfig
    from agoq.train.measure import measure_steps
    from agoq.train.parallel import World
    from agoq.train.preparation import prepare
    from agoq.train.trainer import Trainer

    started = time.perf_counter()
    if args.variant == "compiled-warm":
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
        AsyncCompile.wait_pool_ready()
        time.sleep(WARM_SECONDS)
    load, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.5):
            load.append((round(time.perf_counter() - started, 2), os.getloadavg()[0]))

    threading.Thread(target=sample, daemon=True).start()
    cfg = TrainConfig(model=args.model, device="cuda" if torch.cuda.is_available() else "cpu", dtype="bf16",
                      seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=1, gradients="bf16",
                      optimizer=args.optimizer, master="fp32", compile=args.variant != "eager", steps=args.steps,
                      warmup=1, seed=0, checkpoint_every=0, quiet=True)
    if not args.profile_steps or not torch.cuda.is_available():
        figures = measure_steps(cfg)
        stop.set()
        return {"seconds_per_step": figures.seconds, "peak_bytes": figures.max_peak_bytes,
                "load_average": load, "wall_seconds": time.perf_counter() - started}
    trainer = Trainer(prepare(cfg, World()))
    results = [trainer.step(step) for step in range(args.steps)]
    profile = profiled(trainer, args.steps, args.profile_steps)
    stop.set()
    return {"seconds_per_step": [r.seconds for r in results], "peak_bytes": max(r.peak_bytes[0] for r in results),
            "load_average": load, "wall_seconds": time.perf_counter() - started, **profile}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="probe")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--variants", default="compiled,compiled-1thread,compiled-warm,eager")
    ap.add_argument("--optimizer", default="adamw8bit", choices=["adamw", "adamw8bit"])
    ap.add_argument("--profile-steps", type=int, default=0)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one variant, in a child process
    ap.add_argument("--name", default="step_warmup")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(one(args)))
        return
    from experiments.record import write_result

    figures = {"model": args.model, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
               "optimizer": args.optimizer, "variants": {}}
    cache = tempfile.mkdtemp(prefix="step_warmup_cache_")
    for variant in args.variants.split(","):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
               **ENVIRONMENTS.get(variant, {})}
        cmd = [sys.executable, __file__, "--variant", variant, "--model", args.model, "--micro-batch",
               str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--optimizer", args.optimizer, "--profile-steps", str(args.profile_steps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            figures["variants"][f"{variant} {len(figures['variants'])}"] = {"error": done.stderr[-2000:]}
            print(variant, "failed:", done.stderr[-2000:], flush=True)
            continue
        got = json.loads(done.stdout.strip().splitlines()[-1])
        key = variant if variant not in figures["variants"] else f"{variant} (again: Inductor's cache warm)"
        key = key if key not in figures["variants"] else f"{key} {len(figures['variants'])}"
        figures["variants"][key] = got
        ms = [round(s * 1e3) for s in got["seconds_per_step"]]
        print(f"{variant}: first {ms[0]} ms, then {ms[1:]}", flush=True)
        write_result(args.name, figures)


if __name__ == "__main__":
    main()
