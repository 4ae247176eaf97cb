"""At a memory budget where bf16 training needs full activation checkpointing, train with the plan that
`agoq search` finds for that budget and with full checkpointing, and compare their step times.

  1. profile  `agoq profile MODEL --seq-len S --micro-batch B --out OUT/profile` (GPU)
  2. search   from the profile's cost model: P_full = predicted peak with every layer checkpointed, P_bf16 =
              predicted peak keeping everything; budget = P_full + 0.9 (P_bf16 - P_full) / L, where no
              selective checkpointing fits (leaving any one layer un-checkpointed adds (P_bf16 - P_full) / L),
              so bf16 needs full checkpointing; then `agoq search --profile OUT/profile --budget BUDGET
              --objective time --error-cap recipe --out OUT/plan.json` (MILP: the fastest plan whose
              predicted gradient error is at most the published agoq-paper recipe's)
  3. train    `agoq train MODEL --plan OUT/plan.json` and `agoq train MODEL --checkpoint-all` (and plain bf16
              for reference), same data (tinyshakespeare.txt), steps, seed; median step time after the first
              10 steps, peak memory, final validation loss

Reports speed-up = checkpointing step time / plan step time (the paper reports 1.22x-1.34x from exactly
this), peaks against the budget, validation losses. The three run folders (without checkpoints) go to
experiments/results/runs/ for the dashboard. Phases run apart with --phase (profile and train need
only torch on the GPU; search needs scipy, pandas and pydantic).

GPU (one H200; profile ~2-4 min, search seconds, 3 runs of 500 steps, under a minute each):
    python experiments/train_vs_checkpointing.py --out runs/vs-checkpointing
CPU check:
    python experiments/train_vs_checkpointing.py --tiny --out /tmp/agoq-vs-ckpt
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import RESULTS, write_result  # noqa: E402
from experiments.train_runs import (  # noqa: E402
    BYTE_MODEL,
    ROOT,
    drop_checkpoint,
    relative_difference,
    run_train,
    summarize,
    tiny_shakespeare,
)


def _agoq(*args: str) -> None:
    cmd = [sys.executable, "-m", "agoq.cli", *args]
    print("$ " + " ".join(cmd), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"  {time.perf_counter() - t:.0f} s", flush=True)


def budget_from_profile(folder: Path) -> dict:
    """The budget at which only full checkpointing fits, from the search's own cost model."""
    import numpy as np

    from agoq.formats.profile import load_profile
    from agoq.search.costs import build_problem, checkpointing_only

    profile = load_profile(folder)
    only = checkpointing_only(build_problem(profile))
    layers = profile.num_layers
    full = only.evaluate(np.array([], dtype=int), np.ones(layers, dtype=bool))
    keep = only.evaluate(np.array([i for i, o in enumerate(only.option) if o == "16"]), np.zeros(layers, dtype=bool))
    p_full, p_bf16 = max(full["peak_bytes_per_stage"]), max(keep["peak_bytes_per_stage"])
    budget = int(p_full + 0.9 * (p_bf16 - p_full) / layers)
    return {"predicted_full_checkpointing_peak": int(p_full), "predicted_bf16_peak": int(p_bf16),
            "layers": layers, "budget_bytes": budget,
            "predicted_full_checkpointing_step_seconds": float(full["step_seconds"]),
            "predicted_bf16_step_seconds": float(keep["step_seconds"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the profile, the plan and the runs")
    parser.add_argument("--phase", choices=("all", "profile", "search", "train"), default="all")
    parser.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=500,
                        help="optimizer steps (default 500: about 8 passes over tinyshakespeare's 90 %% at micro-batch "
                             "16 x 1024; the validation loss rises from about step 500 as the model memorises)")
    parser.add_argument("--eval-batches", type=int, default=16, help="validation batches (default 16)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="CPU check: llama-tiny, seq 64, 12 steps")
    parser.add_argument("--name", default="train_vs_checkpointing")
    args = parser.parse_args(argv)
    model = str(BYTE_MODEL)
    if args.tiny:
        model, args.seq_len, args.micro_batch, args.steps, args.device = "llama-tiny", 64, 2, 12, "cpu"
        args.eval_batches = 4
        args.name += "_tiny"
    out = Path(args.out)
    profile_dir, plan_path = out / "profile", out / "plan.json"
    if args.phase in ("all", "profile"):
        _agoq("profile", model, "--device", args.device, "--seq-len", str(args.seq_len), "--micro-batch",
              str(args.micro_batch), "--batches", "2", "--out", str(profile_dir), "--quiet")
    if args.phase in ("all", "search"):
        budget = budget_from_profile(profile_dir)
        (out / "budget.json").write_text(json.dumps(budget, indent=2) + "\n")
        _agoq("search", "--profile", str(profile_dir), "--budget", str(budget["budget_bytes"]), "--objective",
              "time", "--error-cap", "recipe", "--out", str(plan_path), "--quiet")
    if args.phase not in ("all", "train"):
        return 0
    budget = json.loads((out / "budget.json").read_text())
    plan = json.loads(plan_path.read_text())
    data = tiny_shakespeare(args.data)
    common = [model, "--data", data, "--seq-len", str(args.seq_len),
              "--steps", str(args.steps), "--eval-every", str(max(1, args.steps // 10)), "--eval-batches",
              str(args.eval_batches),
              "--checkpoint-every", "0", "--seed", "0", "--device", args.device, "--quiet"]
    # the plan runs its own micro-batch x accumulation (agoq train refuses a --micro-batch that contradicts it)
    shape = ["--micro-batch", str(args.micro_batch)]
    variants = {"plan": ["--plan", str(plan_path)], "checkpoint_all": ["--checkpoint-all", *shape], "bf16": shape}
    runs = {}
    for name, extra in variants.items():
        run_dir = (out / "runs" / name) if args.tiny else (RESULTS / "runs" / f"{args.name}_{name}")
        if run_dir.exists():
            shutil.rmtree(run_dir)
        wall = run_train(common + extra + ["--out", str(run_dir)])
        drop_checkpoint(run_dir)
        runs[name] = {**summarize(run_dir), "wall_seconds": wall}
    plan_s, ckpt_s = runs["plan"]["median_step_seconds"], runs["checkpoint_all"]["median_step_seconds"]
    figures = {
        "budget": budget, "runs": runs,
        "plan": {"layers": plan["layers"], "predicted": plan["predicted"], "gradients": plan["gradients"]},
        "speedup_plan_vs_full_checkpointing": ckpt_s / plan_s,
        "final_val_loss_vs_bf16": {k: relative_difference(r["final_val_loss"], runs["bf16"]["final_val_loss"])
                                   for k, r in runs.items() if k != "bf16"},
        "plan_faster": plan_s < ckpt_s,
        "measured_peak_within_budget": {k: (r["peak_bytes_per_rank"][0] <= budget["budget_bytes"]
                                            if args.device.startswith("cuda") else None) for k, r in runs.items()},
        "note": "peaks are measured by agoq train (float32 master weights and AdamW moments included), the budget "
                "and the plan's prediction by the search's cost model",
    }
    if args.tiny:
        path = out / f"{args.name}.json"
        path.write_text(json.dumps(figures, indent=2) + "\n")
    else:
        path = write_result(args.name, figures)
    print(f"step: plan {plan_s * 1e3:.1f} ms, full checkpointing {ckpt_s * 1e3:.1f} ms, bf16 "
          f"{runs['bf16']['median_step_seconds'] * 1e3:.1f} ms; speed-up x{ckpt_s / plan_s:.2f}; final val loss "
          + ", ".join(f"{k} {r['final_val_loss']:.4f}" for k, r in runs.items()) + f"; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
