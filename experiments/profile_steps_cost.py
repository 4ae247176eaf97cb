"""Where the time of `agoq profile`'s measured steps goes: for a set of step kinds (agoq.commands.profile_steps),
each measured as the profile measures it (agoq.train.measure.measure_steps), the seconds of each part of one
measurement: releasing the last one, preparing the run (model built, plan applied), the first step (compilation,
first allocations), the later steps, and tearing down; two passes, the second in reverse order, as the profile's.

    python experiments/profile_steps_cost.py --model probe --micro-batch 2 --seq-len 4096   # one H200, ~3 min

Writes experiments/results/profile_steps_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.commands.profile_steps import step_kinds, train_settings
from agoq.train import measure as measure_module
from agoq.train.config import TrainConfig
from experiments.record import write_result


def timed_release(parts: dict, when: str) -> None:
    """measure_module._release_memory's three calls, each timed."""
    for name, call in (("gc", gc.collect), ("dynamo_reset", torch._dynamo.reset), ("empty_cache", torch.cuda.empty_cache)):
        t = time.perf_counter()
        call()
        parts[f"{when}_{name}"] = time.perf_counter() - t


def timed_measure(cfg: TrainConfig) -> dict:
    """measure_steps(cfg), its parts timed (the same calls, in the same order)."""
    parts = {}
    timed_release(parts, "before")
    t = time.perf_counter()
    trainer = measure_module.Trainer(measure_module.prepare(cfg, measure_module.World()))
    torch.cuda.synchronize()
    parts["prepare"] = time.perf_counter() - t
    seconds = []
    for step in range(cfg.loop.steps):
        seconds.append(trainer.step(step).seconds)
    trainer.close()
    trainer.parallel.release()
    del trainer
    timed_release(parts, "after")
    return {"parts": parts, "seconds_per_step": seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="probe")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() what exists before the first kind")
    ap.add_argument("--name", default="profile_steps_cost")
    args = ap.parse_args(argv)
    kinds = [k for k in step_kinds(args.micro_batch, ["eager", "compiled"])
             if k["grad_accum"] == 1 and k["optimizer"] == "adamw8bit" and k["master"] == "fp32"
             and k["activation_memory_budget"] is None]
    rows = [{"kind": k, "passes": []} for k in kinds]
    start = time.perf_counter()
    if args.freeze:
        gc.collect()
        gc.freeze()
    for r in range(args.passes):
        order = range(len(kinds)) if r % 2 == 0 else range(len(kinds) - 1, -1, -1)
        for i in order:
            t = time.perf_counter()
            settings = train_settings(kinds[i], args.model, args.seq_len, "bf16", "cuda", args.steps, 0)
            entry = timed_measure(TrainConfig(**settings))
            entry["wall"] = time.perf_counter() - t
            rows[i]["passes"].append(entry)
            p = entry["parts"]
            print(f"pass {r} {kinds[i]['compile']:8} {kinds[i]['policy']:14} {kinds[i]['gradients']:9} "
                  f"m{kinds[i]['micro_batch']}: wall {entry['wall']:.2f} s, prepare {p['prepare']:.2f}, first "
                  f"{entry['seconds_per_step'][0]:.2f}, later {sum(entry['seconds_per_step'][1:]):.2f}, release "
                  + "/".join(f"{p[f'{w}_{n}']:.2f}" for w in ("before", "after")
                             for n in ("gc", "dynamo_reset", "empty_cache")) + "; steps "
                  + " ".join(f"{s * 1e3:.0f}" for s in entry["seconds_per_step"][1:]), flush=True)
    figures = {"freeze": args.freeze, "model": args.model, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
               "wall_seconds": time.perf_counter() - start, "rows": rows}
    print(f"total {figures['wall_seconds']:.1f} s for {len(kinds)} kinds x {args.passes} passes")
    write_result(args.name, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
