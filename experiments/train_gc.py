"""Does freezing the collector after the first step (agoq.train.collector) change a plan's step? `agoq train
--plan` run with AGOQ_GC_FREEZE=1 and =0, alternately (on, off, on, off ...), each for --steps steps on the same
data; per run the median step after the first, of the first and of the second half, against the plan's prediction.

    python experiments/train_gc.py probe --plan PLAN.json --data TEXT --steps 60 --runs 2   # one H200

Writes experiments/results/NAME.json (default train_gc).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.record import write_result  # noqa: E402
from experiments.train_runs import read_metrics, run_train  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=2, help="runs of each setting (default 2)")
    ap.add_argument("--name", default="train_gc")
    args = ap.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    predicted = plan["predicted"].get("step_seconds")
    rows = []
    with tempfile.TemporaryDirectory(prefix="agoq-train-gc-") as tmp:
        for i in range(2 * args.runs):
            freeze = "1" if i % 2 == 0 else "0"
            out = Path(tmp) / f"run{i}"
            run_train([args.model, "--plan", args.plan, "--data", args.data, "--steps", str(args.steps),
                       "--checkpoint-every", "0", "--eval-every", str(args.steps), "--eval-batches", "1", "--quiet",
                       "--out", str(out), "--compile" if plan["training"]["compile"] == "compiled" else "--no-compile"],
                      env={"AGOQ_GC_FREEZE": freeze})
            steps, _ = read_metrics(out)
            seconds = [r["step_seconds"] for r in steps][1:]
            half = len(seconds) // 2
            row = {"freeze": freeze == "1", "median_step_seconds": statistics.median(seconds),
                   "first_half_seconds": statistics.median(seconds[:half]),
                   "second_half_seconds": statistics.median(seconds[half:]),
                   "peak_bytes": max(max(r["peak_bytes"]) for r in steps), "seconds_per_step": seconds}
            rows.append(row)
            print(f"run {i} freeze {row['freeze']}: median {row['median_step_seconds'] * 1e3:.1f} ms (halves "
                  f"{row['first_half_seconds'] * 1e3:.1f}, {row['second_half_seconds'] * 1e3:.1f}); predicted "
                  f"{predicted * 1e3:.1f} ms", flush=True)
    on = [r["median_step_seconds"] for r in rows if r["freeze"]]
    off = [r["median_step_seconds"] for r in rows if not r["freeze"]]
    figures = {"model": args.model, "plan": plan, "steps": args.steps, "predicted_step_seconds": predicted,
               "runs": rows, "median_on": statistics.median(on), "median_off": statistics.median(off),
               "off_over_on": statistics.median(off) / statistics.median(on)}
    print(f"freeze on {figures['median_on'] * 1e3:.1f} ms, off {figures['median_off'] * 1e3:.1f} ms "
          f"(off / on {figures['off_over_on']:.3f}); predicted {predicted * 1e3:.1f} ms")
    write_result(args.name, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
