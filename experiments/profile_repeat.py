"""Whether two profiles of the same model on the same kind of GPU give the same plans.

Two profile folders of one model, taken with the same settings on the same kind of GPU at different times (default:
the probe-h200 profile shipped until 2026-11-28, experiments/results/profiles/probe-h200-1125, and a repeat of it,
experiments/results/profiles/probe-h200-repeat, taken with the settings in its profile.json). At budgets from the
smallest that meets the default search's error cap to the largest useful one, computed from the FIRST profile as
experiments/plan_latency.py does (agoq.search.knobs.budget_bounds), each profile is searched as the service does
(agoq.search.search.search: MILP, no front, no validation, the default objective: the most tokens/s within the
recipe's error cap). Per budget and profile it records the plan's knobs (gradients, optimizer and masters,
micro-batch x accumulation, compile and torch.compile's memory budget), whether it has agoq in it, how many (layer,
kind) settings are quantized or recomputed and how many layers are checkpointed, the predicted step seconds, peak
and tokens/s; then whether the two plans are the same (same knobs and the same per-layer settings) and, if not, the
ratio of their predicted step times (profile B's plan over profile A's).

It also compares the profiles' own measured training steps (profile.json 'measured_steps', rows matched on compile,
policy, micro-batch, accumulation, gradients, optimizer, masters and compile memory budget): the relative difference
of step seconds and of peak bytes, B against A, with the 5 largest of each, and of the seconds the search prices each
row at (agoq.search.timing: the fastest steady step times the profile's median-to-fastest ratio). CPU only.

    python experiments/profile_repeat.py                 # about a minute
    python experiments/profile_repeat.py --a PROFILE_A --b PROFILE_B --name NAME
Writes experiments/results/NAME.json (default profile_repeat).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.plan_latency import default_range  # noqa: E402
from experiments.record import write_result  # noqa: E402

FRACTIONS = (0.0, 0.01, 0.03, 0.1, 0.3, 0.6, 1.0)  # of the way from the smallest to the largest budget
MATCH = ("compile", "policy", "micro_batch", "grad_accum", "gradients", "optimizer", "master",
         "activation_memory_budget")  # what a measured step row is matched on between the profiles
LARGEST = 5


def knobs_of(plan) -> dict:
    """The plan's run settings: what besides the per-layer settings makes two plans the same."""
    t = plan.training
    return {"gradients": plan.gradients.mode, "optimizer": plan.optimizer.name, "master": plan.optimizer.master,
            "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "compile": t.compile,
            "activation_memory_budget": t.activation_memory_budget, "block": plan.activations.block,
            "format": plan.activations.format, "rounding": plan.activations.rounding,
            "pipeline_stages": plan.pipeline.stages}


def layers_of(plan) -> list:
    return [{"stage": lp.stage, "checkpoint": lp.checkpoint, "kinds": dict(lp.kinds)} for lp in plan.layers]


def summary(plan) -> dict:
    settings = [s for lp in plan.layers for s in lp.kinds.values()]
    p = plan.predicted
    return {"knobs": knobs_of(plan), "decision_knobs": plan.decision.knobs if plan.decision else None,
            "agoq": plan.decision.agoq if plan.decision else None,
            "quantized_kinds": sum(1 for s in settings if isinstance(s, int) and s < 16),
            "recomputed_kinds": sum(1 for s in settings if s == "recompute"),
            "checkpointed_layers": len(plan.checkpoint_layers()),
            "predicted_step_seconds": p.step_seconds, "predicted_peak_bytes": max(p.peak_bytes_per_stage),
            "predicted_grad_error": p.grad_error,
            "tokens_per_second": plan.decision.tokens_per_second if plan.decision else None,
            "binding": plan.decision.binding if plan.decision else None}


def measured_rows(folder: Path) -> dict:
    from agoq.files import read_json_object

    rows = read_json_object(folder / "profile.json", "profile").get("measured_steps", {}).get("rows", [])
    return {tuple(r.get(k) for k in MATCH): r for r in rows}


def compare_steps(a: Path, b: Path, profiles: dict) -> dict:
    from agoq.search.timing import prices

    ra, rb = measured_rows(a), measured_rows(b)
    pa, pb = prices(profiles["a"]), prices(profiles["b"])
    both = [k for k in ra if k in rb]
    diffs = []
    for k in both:
        x, y = ra[k], rb[k]
        d = dict(zip(MATCH, k))
        d.update({"step_seconds_a": x["step_seconds"], "step_seconds_b": y["step_seconds"],
                  "step_relative_difference": y["step_seconds"] / x["step_seconds"] - 1.0,
                  "priced_seconds_a": pa.price(x), "priced_seconds_b": pb.price(y),
                  "priced_relative_difference": pb.price(y) / pa.price(x) - 1.0,
                  "peak_bytes_a": x["peak_bytes"], "peak_bytes_b": y["peak_bytes"],
                  "peak_relative_difference": y["peak_bytes"] / x["peak_bytes"] - 1.0})
        diffs.append(d)
    step = sorted(diffs, key=lambda d: -abs(d["step_relative_difference"]))
    peak = sorted(diffs, key=lambda d: -abs(d["peak_relative_difference"]))
    steps = [abs(d["step_relative_difference"]) for d in diffs]
    priced = sorted(abs(d["priced_relative_difference"]) for d in diffs)
    return {"rows_a": len(ra), "rows_b": len(rb), "rows_matched": len(both),
            "median_to_fastest_a": pa.median_to_fastest, "median_to_fastest_b": pb.median_to_fastest,
            "priced_abs_relative_difference_median": priced[len(priced) // 2] if priced else None,
            "priced_abs_relative_difference_largest": priced[-1] if priced else None,
            "only_in_a": [dict(zip(MATCH, k)) for k in ra if k not in rb],
            "only_in_b": [dict(zip(MATCH, k)) for k in rb if k not in ra],
            "step_abs_relative_difference_median": sorted(steps)[len(steps) // 2] if steps else None,
            "largest_step_differences": step[:LARGEST], "largest_peak_differences": peak[:LARGEST]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="experiments/results/profiles/probe-h200-1125",
                    help="the first profile folder (budgets are computed from it)")
    ap.add_argument("--b", default="experiments/results/profiles/probe-h200-repeat", help="the second profile folder")
    ap.add_argument("--name", default="profile_repeat")
    args = ap.parse_args()
    from agoq.formats.profile import load_profile
    from agoq.search.request import InfeasibleBudget
    from agoq.search.search import search

    folders = {"a": Path(args.a), "b": Path(args.b)}
    profiles = {k: load_profile(f) for k, f in folders.items()}
    least, largest, cap = default_range(profiles["a"])  # the default search's range, as plan_latency plans over
    fixed = {"method": "milp", "front_budgets": 0, "validate": 0, "progress": False}
    rows = []
    for frac in FRACTIONS:
        budget = int(least + frac * (largest - least))
        row = {"budget_fraction": frac, "budget_bytes": budget}
        plans = {}
        for k, profile in profiles.items():
            try:
                plans[k] = search(profile, budget, **fixed).plan
                row[k] = summary(plans[k])
            except InfeasibleBudget as e:
                row[k] = {"infeasible": str(e), "smallest_budget": e.smallest_budget}
        if len(plans) == 2:
            a, b = plans["a"], plans["b"]
            row["same_knobs"] = knobs_of(a) == knobs_of(b)
            row["same_layers"] = layers_of(a) == layers_of(b)
            row["same_plan"] = row["same_knobs"] and row["same_layers"]
            row["layers_differing"] = sum(x != y for x, y in zip(layers_of(a), layers_of(b)))
            row["predicted_step_ratio_b_over_a"] = b.predicted.step_seconds / a.predicted.step_seconds
        else:
            row["same_plan"] = None
        rows.append(row)

        def show(s):
            if "infeasible" in s:
                return "infeasible"
            kn = s["knobs"]
            return (f"{kn['compile']}{'' if kn['activation_memory_budget'] is None else '@' + str(kn['activation_memory_budget'])}"
                    f" {kn['gradients']} {kn['optimizer']}/{kn['master']} {kn['micro_batch']}x{kn['grad_accum']}"
                    f" agoq={s['agoq']} q={s['quantized_kinds']} ckpt={s['checkpointed_layers']}"
                    f" {s['predicted_step_seconds'] * 1e3:.2f} ms")
        print(f"budget {budget / 2**30:7.2f} GiB ({frac:4.2f}): A {show(row['a'])} | B {show(row['b'])}"
              f" | same={row['same_plan']}", flush=True)
    same = [r for r in rows if r["same_plan"]]
    ratios = [r["predicted_step_ratio_b_over_a"] for r in rows if r.get("predicted_step_ratio_b_over_a")]
    figures = {"profile_a": args.a, "profile_b": args.b,
               "profile_dates": {k: p_date(f) for k, f in folders.items()},
               "error_cap": cap, "smallest_budget_bytes": least, "largest_budget_bytes": largest,
               "budgets": rows, "budgets_same_plan": len(same), "budgets_compared": len(rows),
               "largest_predicted_step_difference": max((abs(x - 1.0) for x in ratios), default=None),
               "budgets_same_knobs": sum(1 for r in rows if r.get("same_knobs")),
               "measured_steps": compare_steps(folders["a"], folders["b"], profiles),
               "cpu_count": os.cpu_count()}
    ms = figures["measured_steps"]
    print(f"same plan at {len(same)} of {len(rows)} budgets, same knobs at {figures['budgets_same_knobs']}, "
          f"predicted steps at most {figures['largest_predicted_step_difference']:.1%} apart; measured steps: "
          f"{ms['rows_matched']} rows matched, largest step difference "
          f"{ms['largest_step_differences'][0]['step_relative_difference']:+.1%} (priced as the search reads them: "
          f"largest {ms['priced_abs_relative_difference_largest']:.1%}, median "
          f"{ms['priced_abs_relative_difference_median']:.1%}), largest peak difference "
          f"{ms['largest_peak_differences'][0]['peak_relative_difference']:+.1%}")
    print("wrote", write_result(args.name, figures))


def p_date(folder: Path):
    from agoq.files import read_json_object

    return read_json_object(folder / "profile.json", "profile").get("date")


if __name__ == "__main__":
    main()
