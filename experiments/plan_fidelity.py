"""Fidelity of what the search picks: the 129 M byte LLaMA (experiments/train_llama_byte.json) profiled, plans
searched at the tightest budget any plan fits and at half of bf16's peak, each trained beside plain bf16 for the
same steps on tinyshakespeare (bytes, 90/10 split), as a user runs them:

  agoq profile experiments/train_llama_byte.json --seq-len S --micro-batch M
  agoq search --profile P --budget B --out plan.json                 (defaults: most tokens/s within the recipe's error)
  agoq train experiments/train_llama_byte.json --plan plan.json --data TEXT --steps N ...
  agoq train experiments/train_llama_byte.json --data TEXT --steps N --micro-batch M   (bf16, compiled on a GPU)

The same seed, data order, learning-rate schedule and evaluation for all; runs at the same time on one GPU
(--concurrent; their losses are unaffected, their step times not comparable). Goal: each plan's final validation
loss within 1 % of bf16's. Two references beside them (--no-references leaves them out): bf16 with the plans'
8-bit AdamW (the optimizer's share of a difference) and bf16 with seed 1 (how far bf16 lands from itself).

GPU (one H200, about 6 minutes): python experiments/plan_fidelity.py --data TEXT --concurrent
CPU check: python experiments/plan_fidelity.py --tiny
Writes experiments/results/plan_fidelity.json (plan_fidelity_tiny.json for --tiny) and the run folders without
checkpoints under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import RESULTS, write_result  # noqa: E402
from experiments.train_runs import BYTE_MODEL, drop_checkpoint, summarize, tiny_shakespeare  # noqa: E402

AGOQ = [sys.executable, "-m", "agoq.cli"]
GOAL = 0.01


def sh(cmd: list[str], log: Path) -> None:
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def fits(profile, budget: int) -> int:
    """`budget`, or just above the smallest the default search fits (under its error cap) where that is more."""
    from agoq.search.request import InfeasibleBudget
    from agoq.search.search import plan_from_profile

    try:
        plan_from_profile(profile, budget)
        return budget
    except InfeasibleBudget as e:
        if e.smallest_budget is None:
            raise
        return int(e.smallest_budget * 1.002)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/)")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--concurrent", action="store_true", help="train the runs at the same time")
    ap.add_argument("--out", default="/tmp/agoq-plan-fidelity", help="folder for profile, plans and runs")
    ap.add_argument("--profile", default=None, help="reuse this profile folder instead of profiling")
    ap.add_argument("--budget-list", default=None, metavar="SIZES",
                    help="comma-separated budgets in bytes instead of the tightest and half of bf16's peak")
    ap.add_argument("--name", default=None, help="results name (default plan_fidelity)")
    ap.add_argument("--tiny", action="store_true", help="CPU check: llama-tiny, 30 steps, sequences of 64")
    ap.add_argument("--references", action=argparse.BooleanOptionalAction, default=True,
                    help="also train bf16 with the plans' 8-bit AdamW and bf16 with seed 1 (the baseline's spread)")
    args = ap.parse_args()
    model, device, name = str(BYTE_MODEL), [], "plan_fidelity"
    if args.tiny:
        model, args.steps, args.seq_len, args.eval_every, args.eval_batches = "llama-tiny", 30, 64, 10, 2
        device, name = ["--device", "cpu"], "plan_fidelity_tiny"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = tiny_shakespeare(args.data)
    started = time.perf_counter()
    profile = Path(args.profile) if args.profile else out / "profile"
    if not args.profile:
        sh(AGOQ + ["profile", model, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                   "--bits", "2,3,4,5,6,8", "--formats", "int", "--batches", "1", "--out", str(profile),
                   "--quiet", *device], out / "profile.log")

    from agoq.formats.profile import load_profile
    from agoq.search.alternatives import price_alternatives
    from agoq.search.knobs import budget_bounds

    prof = load_profile(profile)
    least, _ = budget_bounds(prof)
    eager = [a for a in price_alternatives(prof, float("inf"), [(args.micro_batch, 1)], ["eager"])
             if a.name.startswith("eager bf16")]
    bf16_peak = max(a.peak_bytes for a in eager)
    if args.budget_list:
        budgets = {f"{int(b) / 1e9:.3f}GB": fits(prof, int(b)) for b in args.budget_list.split(",")}
    else:
        budgets = {label: fits(prof, b) for label, b in (("tightest", int(least * 1.01)),
                                                         ("half of bf16's peak", max(int(least * 1.01), bf16_peak // 2)))}
    common = [model, "--data", data, "--steps", str(args.steps), "--eval-every", str(args.eval_every),
              "--eval-batches", str(args.eval_batches), "--checkpoint-every", "0", "--seed", "0", "--quiet", *device]
    plain = common + ["--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
    runs = {"bf16": plain}
    if args.references:  # what the 1 % is measured against: the baseline's own spread, and the optimizer's share
        runs["bf16-adamw8bit"] = plain + ["--optimizer", "adamw8bit"]
        runs["bf16-seed1"] = [a if i == 0 or plain[i - 1] != "--seed" else "1" for i, a in enumerate(plain)]
    plans = {}
    for label, budget in budgets.items():
        path = out / f"plan-{label.split()[0]}.json"
        sh(AGOQ + ["search", "--profile", str(profile), "--budget", str(budget), "--out", str(path),
                   "--quiet", "--front-budgets", "0"], out / f"search-{label.split()[0]}.log")
        plan = json.loads(path.read_text())
        plans[label] = {"budget_bytes": budget, "agoq": (plan.get("decision") or {}).get("agoq", True),
                        "reason": (plan.get("decision") or {}).get("reason"),
                        "quantized_kinds": sum(1 for lp in plan["layers"] for s in lp["kinds"].values() if s != 16),
                        "checkpointed_layers": sum(lp["checkpoint"] for lp in plan["layers"]),
                        "offloaded_layers": [i for i, lp in enumerate(plan["layers"]) if lp.get("offload")],
                        "gradients": plan["gradients"]["mode"], "optimizer": plan["optimizer"],
                        "training": plan["training"], "predicted": plan["predicted"].get("step_seconds")}
        runs[label] = common + ["--plan", str(path)]

    def train(item):
        label, argv = item
        run_dir = out / f"run-{label.split()[0]}"
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        sh(AGOQ + ["train", *argv, "--out", str(run_dir)], out / f"train-{label.split()[0]}.log")
        drop_checkpoint(run_dir)
        return label, summarize(run_dir)

    with ThreadPoolExecutor(max_workers=len(runs) if args.concurrent else 1) as pool:
        results = dict(pool.map(train, runs.items()))
    base = results["bf16"]["final_val_loss"]
    figures = {"model": model, "steps": args.steps, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
               "concurrent": args.concurrent, "smallest_feasible_bytes": least, "bf16_eager_peak_bytes": bf16_peak,
               "plans": plans, "runs": results, "goal": GOAL, "wall_seconds": time.perf_counter() - started}
    for label in budgets:
        final = results[label]["final_val_loss"]
        figures["plans"][label]["final_val_loss"] = final
        figures["plans"][label]["val_loss_vs_bf16"] = final / base - 1
        figures["plans"][label]["met"] = abs(final / base - 1) <= GOAL
        print(f"{label}: val loss {final:.4f} vs bf16 {base:.4f} ({final / base - 1:+.2%})", flush=True)
    for label in ("bf16-adamw8bit", "bf16-seed1"):
        if label in results:
            final = results[label]["final_val_loss"]
            figures[f"{label}_val_loss_vs_bf16"] = final / base - 1
            print(f"{label}: val loss {final:.4f} vs bf16 {base:.4f} ({final / base - 1:+.2%})", flush=True)
    print("wrote", write_result(args.name or name, figures))


if __name__ == "__main__":
    main()
