"""How a fresh training process's step time settles: every step's seconds of `agoq train`'s step (measure_steps), each
variant in a process of its own, with the host's load average sampled beside it.

Variants (--variants, comma-separated):
  compiled           compiled bf16 + 8-bit AdamW, as agoq train runs it (named twice: the second run finds its graphs
                     in Inductor's cache)
  compiled-1thread   the same with TORCHINDUCTOR_COMPILE_THREADS=1 (Inductor compiles in this process: no worker pool)
  compiled-warm      the same after Inductor's worker pool was started and answered (AsyncCompile.warm_pool,
                     wait_pool_ready) and WARM_SECONDS more seconds passed, before the model is built
  eager              eager bf16 + 8-bit AdamW

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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WARM_SECONDS = 10.0


def one(args) -> dict:
    """One variant in this process: per-step seconds and the load average every half second."""
    import torch

    from agoq.train.config import TrainConfig
    from agoq.train.measure import measure_steps

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
                      optimizer="adamw8bit", master="fp32", compile=args.variant != "eager", steps=args.steps,
                      warmup=1, seed=0, checkpoint_every=0, quiet=True)
    figures = measure_steps(cfg)
    stop.set()
    return {"seconds_per_step": figures.seconds, "peak_bytes": figures.max_peak_bytes,
            "load_average": load, "wall_seconds": time.perf_counter() - started}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="probe")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--variants", default="compiled,compiled-1thread,compiled-warm,eager")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one variant, in a child process
    ap.add_argument("--name", default="step_warmup")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(one(args)))
        return
    from experiments.record import write_result

    figures = {"model": args.model, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
               "variants": {}}
    for variant in args.variants.split(","):
        env = dict(os.environ)
        if variant == "compiled-1thread":
            env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        cmd = [sys.executable, __file__, "--variant", variant, "--model", args.model, "--micro-batch",
               str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            figures["variants"][f"{variant} {len(figures['variants'])}"] = {"error": done.stderr[-2000:]}
            print(variant, "failed:", done.stderr[-2000:], flush=True)
            continue
        got = json.loads(done.stdout.strip().splitlines()[-1])
        key = variant if variant not in figures["variants"] else f"{variant} (again: Inductor's cache warm)"
        figures["variants"][key] = got
        ms = [round(s * 1e3) for s in got["seconds_per_step"]]
        print(f"{variant}: first {ms[0]} ms, then {ms[1:]}", flush=True)
        write_result(args.name, figures)


if __name__ == "__main__":
    main()
