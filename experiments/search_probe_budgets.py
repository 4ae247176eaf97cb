"""Plans at 50 % and 30 % of the bf16 activation memory, measured, against activation checkpointing.

End to end, as a user would run it:
  1. profile   `agoq profile MODEL --out DIR` (the real command, in a subprocess)
  2. search    for each fraction f: budget = (the bf16 step's peak without the decoder layers' activations)
               + f x (bf16 decoder-layer activations); the agoq plan (MILP, objective error, time cap: the
               best checkpointing that fits) and the best full-or-selective checkpointing configuration
               that fits the same budget (MILP over {keep layer, checkpoint layer}, least time)
  3. measure   real training steps (agoq train's, synthetic corpus) of: plain bf16, full checkpointing, and per
               budget the agoq plan and the checkpointing configuration: peak memory
               (torch.cuda.max_memory_allocated, the largest of any step), median step time, loss deviation

Checks per budget: measured peak <= budget, |measured - predicted| / predicted <= 5 %, agoq step time <=
the checkpointing configuration's. Phases can run apart (`--phase search` where scipy/pandas/pydantic are
installed, `--phase measure` where only torch is): the search phase writes OUT/plans.json.

GPU (one H200):  python experiments/search_probe_budgets.py --model probe --device cuda --out runs/probe-budgets
CPU check:       python experiments/search_probe_budgets.py --model llama-tiny --device cpu --out /tmp/pb
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402

PEAK_TOLERANCE = 0.05


def profile_phase(args, folder: Path) -> None:
    cmd = [sys.executable, "-m", "agoq.cli", "profile", args.model, "--device", args.device, "--out", str(folder),
           "--micro-batch", str(args.micro_batch), "--batches", str(args.batches)]
    if args.seq_len:
        cmd += ["--seq-len", str(args.seq_len)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.bits:
        cmd += ["--bits", args.bits]
    print("$ " + " ".join(cmd), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"profile took {time.perf_counter() - t:.0f} s", flush=True)


def search_phase(args, folder: Path, out: Path) -> dict:
    import numpy as np

    from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
    from agoq.formats.profile import load_profile
    from agoq.models import resolve_config
    from agoq.search.costs import ProblemSettings, build_problem, checkpointing_only
    from agoq.search.milp import Allocation, InfeasibleBudget, Solver
    from agoq.search.search import plan_from_profile
    from agoq.search.plan_builder import build_plan

    profile = load_profile(folder)
    problem = build_problem(profile)
    s = profile.settings
    elem = {"bf16": 2, "fp16": 2, "fp32": 4}[s.get("dtype", "bf16")]
    shape = LayerShape.from_config(resolve_config(profile.model_config()), s["micro_batch"], s["seq_len"], elem)
    layer_bytes_bf16 = profile.num_layers * sum(predict_layer_bytes(shape, None).values())
    static = float(problem.static_bytes[0])
    result = {"profile": str(folder), "bf16_layer_activation_bytes": int(layer_bytes_bf16),
              "static_and_fixed_bytes": int(static), "optimizer_step_floor_bytes": int(problem.peak_floor()[0]),
              "cost_model_notes": problem.notes, "budgets": []}
    plans = {"bf16": None}
    only = checkpointing_only(problem)
    every = np.ones(profile.num_layers, dtype=bool)
    f = only.evaluate(np.array([], dtype=int), every)
    full = build_plan(profile, only, Allocation(np.array([], dtype=int), every, f["peak_bytes_per_stage"],
                                                f["step_seconds"], f["grad_error"]),
                      ProblemSettings(), None, "checkpointing", "time")
    plans["full-checkpointing"] = full.to_dict()
    result["full_checkpointing_predicted"] = full.predicted.model_dump()
    keep_all = only.evaluate(np.array([i for i, o in enumerate(only.option) if o == "16"]),
                             np.zeros(profile.num_layers, dtype=bool))
    bf16_step = next((st for st in profile.memory.get("steps", []) if st.get("policy") == "bf16"), {})
    result["bf16_peak_cost_model_bytes"] = keep_all["peak_bytes_per_stage"][0]
    result["bf16_peak_profile_measured_bytes"] = bf16_step.get("measured_peak_bytes")
    for frac in args.fractions:
        budget = int(static + frac * layer_bytes_bf16)
        entry = {"fraction": frac, "budget_bytes": budget}
        # objective "error": the least gradient error no slower than the best checkpointing that fits;
        # objective "time": the fastest plan that fits, whatever its error
        for objective, name, kwargs in (("error", f"agoq-{frac}", {}),
                                        ("time", f"agoq-time-{frac}", {"objective": "time", "time_cap": None,
                                                                        "error_cap": args.error_cap})):
            key = "agoq" if objective == "error" else "agoq_time"
            try:
                plan = plan_from_profile(profile, budget, **kwargs)
                plans[name] = plan.to_dict()
                entry[f"{key}_predicted"] = plan.predicted.model_dump()
                entry[f"{key}_layers"] = [lp.model_dump() for lp in plan.layers]
            except ValueError as e:
                entry[f"{key}_error"] = str(e)
        try:
            only = checkpointing_only(problem)
            alloc = Solver(only).solve(budget, "time")
            ck = build_plan(profile, only, alloc, ProblemSettings(), budget, "checkpointing", "time")
            plans[f"checkpointing-{frac}"] = ck.to_dict()
            entry["checkpointing_layers"] = ck.checkpoint_layers()
            entry["checkpointing_predicted"] = ck.predicted.model_dump()
        except InfeasibleBudget as e:
            entry["checkpointing_error"] = f"no full-or-selective checkpointing fits: {e}"
        result["budgets"].append(entry)
    blob = {"search": result, "plans": plans, "model_config": profile.model_config(), "error_cap": args.error_cap,
            "dtype": s.get("dtype", "bf16"), "micro_batch": s["micro_batch"], "seq_len": s["seq_len"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "plans.json").write_text(json.dumps(blob, indent=2, default=str))
    return blob


def measure_phase(args, blob: dict) -> dict:
    from agoq.search.validation import loss_deviation
    from agoq.train.measure import measure_plan

    runs = {}
    for name, plan in blob["plans"].items():
        print(f"measuring {name} ...", flush=True)
        try:
            r = measure_plan(plan, blob["model_config"], dtype=blob["dtype"], micro_batch=blob["micro_batch"],
                             seq_len=blob["seq_len"], steps=args.steps, seed=0, device=args.device)
        except Exception as e:  # noqa: BLE001 - an out-of-memory configuration is a result too
            runs[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            if args.device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
            continue
        runs[name] = r
        print(f"  peak {r['peak_bytes']}, step {r['step_seconds'] * 1e3:.1f} ms", flush=True)
    ref = runs.get("bf16", {}).get("losses")
    for name, r in runs.items():
        if ref and "losses" in r:
            r["loss_deviation"] = loss_deviation(r["losses"], ref)
    checks = []
    for entry in blob["search"]["budgets"]:
        frac, budget = entry["fraction"], entry["budget_bytes"]
        c = runs.get(f"checkpointing-{frac}", {})
        for key, name in (("agoq", f"agoq-{frac}"), ("agoq_time", f"agoq-time-{frac}")):
            a = runs.get(name, {})
            if f"{key}_predicted" not in entry:
                continue
            row = {"fraction": frac, "budget_bytes": budget, "plan": name,
                   "objective": "error" if key == "agoq" else "time"}
            if "peak_bytes" in a:
                predicted = max(entry[f"{key}_predicted"]["peak_bytes_per_stage"])
                row.update(agoq_measured_peak=a["peak_bytes"], agoq_predicted_peak=predicted,
                           agoq_step_seconds=a["step_seconds"],
                           agoq_predicted_step_seconds=entry[f"{key}_predicted"]["step_seconds"],
                           agoq_predicted_grad_error=entry[f"{key}_predicted"].get("grad_error"),
                           agoq_loss_deviation=a.get("loss_deviation"))
                if a["peak_bytes"] is not None:
                    static = blob["search"]["static_and_fixed_bytes"]
                    row["peak_within_budget"] = a["peak_bytes"] <= budget
                    row["peak_relative_error"] = (a["peak_bytes"] - predicted) / predicted
                    row["peak_within_5_percent"] = abs(row["peak_relative_error"]) <= PEAK_TOLERANCE
                    row["activation_part_relative_error"] = ((a["peak_bytes"] - static) - (predicted - static)) / \
                        max(predicted - static, 1)
            if "step_seconds" in c:
                row.update(checkpointing_step_seconds=c["step_seconds"], checkpointing_measured_peak=c["peak_bytes"],
                           checkpointing_layers=entry.get("checkpointing_layers"))
                if "step_seconds" in a:
                    row["agoq_not_slower"] = a["step_seconds"] <= c["step_seconds"]
                    row["agoq_speedup_vs_checkpointing"] = c["step_seconds"] / a["step_seconds"]
            else:
                row["checkpointing"] = entry.get("checkpointing_error") or c.get("error")
            checks.append(row)
    return {"runs": {k: {kk: vv for kk, vv in v.items() if kk != "losses"} | {"losses": v.get("losses")}
                     for k, v in runs.items()}, "checks": checks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="probe", help="model preset (default probe)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    parser.add_argument("--out", required=True, help="folder for the profile, plans.json and the result")
    parser.add_argument("--phase", choices=("all", "profile", "search", "measure"), default="all")
    parser.add_argument("--fractions", default="0.5,0.3", help="fractions of bf16 activation memory (default 0.5,0.3)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the profiler's (4096 on CUDA)")
    parser.add_argument("--dtype", default=None, help="default: the profiler's (bf16 on CUDA)")
    parser.add_argument("--batches", type=int, default=2, help="profiling batches (default 2)")
    parser.add_argument("--bits", default=None, help="bit widths to profile, e.g. 2,3,4,5,6,8 (default: profiler's)")
    parser.add_argument("--error-cap", type=float, default=None,
                        help="largest predicted gradient error of the fastest plan (default: none); e.g. the "
                             "agoq-paper recipe's own predicted error")
    parser.add_argument("--steps", type=int, default=8, help="measured training steps per configuration (default 8)")
    parser.add_argument("--name", default=None, help="result name (default search_probe_budgets_MODEL)")
    args = parser.parse_args()
    args.fractions = [float(f) for f in args.fractions.split(",")]
    out = Path(args.out)
    folder = out / "profile"
    figures = {"model": args.model, "device": args.device}
    if args.phase in ("all", "profile"):
        profile_phase(args, folder)
        if args.phase == "profile":
            return 0
    if args.phase in ("all", "search"):
        blob = search_phase(args, folder, out)
        if args.phase == "search":
            print(f"wrote {out / 'plans.json'}")
            return 0
    else:
        blob = json.loads((out / "plans.json").read_text())
    figures["search"] = blob["search"]
    figures["error_cap"] = blob.get("error_cap")
    figures.update(measure_phase(args, blob))
    for row in figures["checks"]:
        print(json.dumps({k: v for k, v in row.items() if k != "checkpointing_layers"}))
    name = args.name or f"search_probe_budgets_{args.model}"
    path = write_result(name, figures, out_dir=out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
