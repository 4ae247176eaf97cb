"""Plans as a user meets them: `agoq profile`, `agoq search` at budgets across the range, then `agoq train --plan`,
with the alternatives the search priced trained the same way in the same run.

For one model:
  1. profile    `agoq profile MODEL` (a subprocess; --profile-args adds flags, --profile reuses a folder)
  2. budgets    --budgets N budgets spread evenly from the smallest any plan fits (agoq.search.knobs.budget_bounds)
                to bf16's eager peak at the profiled micro-batch (the eager bf16 alternative's predicted peak)
  3. search     `agoq search --profile P --budget B` for each budget, once per --modes entry: "default" (the
                search's defaults) and "eager" (--compile eager); --search-args adds flags to each
  4. train      `agoq train MODEL --plan plan.json --data TEXT --steps S`, and the --alternatives fastest fitting
                alternatives of that plan (its `alternatives` list), each written as a plan with no agoq in it
                (every kind at 16, the alternative's checkpointed layers, optimizer, masters, batch split and
                compile mode) and trained the same way; compile's activation_memory_budget alternatives are
                trained when the plan schema carries `training.activation_memory_budget`, else listed as skipped
From each run's metrics.jsonl: the first step's peak, the largest peak of any step (a run must survive every
step), the median step seconds of the second half of the steps (the steady state: a fresh process's first seconds
after compiling run slower, experiments/step_warmup.py; every step's seconds are in the run's metrics.jsonl), the
first half's median beside it, and the run's wall seconds (compile included).

Checks per plan: measured peak (every step) <= budget, within 2 % of the predicted peak; median step within 5 % of
the prediction; plan tokens/s >= 0.98 x the fastest alternative measured at the same budget.

GPU, the probe (one H200; about 8 minutes for 4 budgets):
  python experiments/plan_accuracy.py --model probe --micro-batch 2 --seq-len 4096 --data TEXT --budgets 4
Split over several calls: --work DIR keeps the profile and runs, --only I,J runs those budget indices.
GPU, a cluster (2 H200s over NCCL's socket transport; the profile runs with --world-size 2 and measures each
layout's real step, the plans and DDP / FSDP2 bf16 trained beside them under torchrun):
  python experiments/plan_accuracy.py --model probe --micro-batch 2 --seq-len 4096 --data TEXT --nproc 2 \
    --transport sockets --budget-list 14GB,18GB,24GB --modes default --always "DDP compiled bf16,FSDP2 eager bf16" \
    --steps 30 --work work/c2 --name cluster_plans_2gpu_sockets
4 GPUs as 2 nodes of 2 (NVLink in a pair, the socket between pairs): --nproc 4 --transport nodes.
CPU smoke (tiny model, no compile): python experiments/plan_accuracy.py --smoke
Writes experiments/results/NAME.json (--name, default plan_accuracy_MODEL) after every budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoq.parallel_dims import plan_dims  # noqa: E402
from agoq.train.plan_check import steady_seconds  # noqa: E402
from experiments.record import write_result  # noqa: E402

AGOQ = [sys.executable, "-m", "agoq.cli"]


# several ranks: `agoq train` under torchrun, as a user launches a plan on one node (--nproc), over NVLink or over
# NCCL's socket transport on loopback standing in for a network between nodes (--transport sockets:
# experiments.train_runs.SOCKETS_ENV)
LAUNCH: dict = {"nproc": 1, "env": {}}


def run(cmd: list[str], log: Path) -> dict:
    """Run `cmd`, its output to `log`; returns {code, seconds, tail (the last lines on failure)}."""
    print("$ " + " ".join(cmd), flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, **LAUNCH["env"]}).returncode
    out = {"code": code, "seconds": time.perf_counter() - t}
    if code != 0:
        out["tail"] = log.read_text(errors="replace")[-3000:]
        print(out["tail"], flush=True)
    return out


def budgets(profile_dir: Path, n: int) -> tuple[list[int], dict]:
    """`n` budgets from the smallest any plan fits to bf16's eager peak (see the module docstring)."""
    from agoq.formats.profile import load_profile
    from agoq.search.alternatives import price_alternatives
    from agoq.search.knobs import budget_bounds

    prof = load_profile(profile_dir)
    mb = int(prof.settings["micro_batch"])
    smallest, largest = budget_bounds(prof)
    eager = [a for a in price_alternatives(prof, float("inf"), [(mb, 1)], ["eager"]) if a.name.startswith("eager bf16")]
    top = max(a.peak_bytes for a in eager) if eager else largest
    top = max(top, smallest + 1)
    from agoq.search.request import InfeasibleBudget
    from agoq.search.search import plan_from_profile

    try:  # the default search's error cap may need more than the smallest any plan fits
        plan_from_profile(prof, int(smallest * 1.002))
    except InfeasibleBudget as e:
        smallest = e.smallest_budget or smallest
    points = [int(smallest + (top - smallest) * i / max(1, n - 1)) for i in range(n)]
    points[0] = int(smallest * 1.002)  # the smallest is a fit to the byte: leave rounding room
    return points, {"smallest_feasible_bytes": smallest, "largest_useful_bytes": largest, "bf16_eager_peak_bytes": top}


def measured(run_dir: Path) -> dict:
    """First-step peak, every step's largest peak and the median step seconds of a finished run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_seconds" in r]
    if not steps:
        return {}
    peaks = [max(p for p in r["peak_bytes"] if p is not None) if r.get("peak_bytes") and any(
        p is not None for p in r["peak_bytes"]) else None for r in steps]
    seconds = [r["step_seconds"] for r in steps]
    timed = steady_seconds(seconds)  # agoq train's own judgement: a fresh process can run its first seconds slower
    skip = len(seconds) - len(timed)
    known = [p for p in peaks if p is not None]
    return {"steps": len(steps), "first_step_peak_bytes": peaks[0], "peak_bytes": max(known) if known else None,
            "later_peak_bytes": max([p for p in peaks[1:] if p is not None], default=None),
            "step_seconds": statistics.median(timed), "first_step_seconds": steps[0]["step_seconds"],
            "first_half_step_seconds": statistics.median(seconds[1:skip] or timed),
            "step_seconds_spread": (max(timed) - min(timed)) / statistics.median(timed) if len(timed) > 1 else 0.0}


def alternative_plan(plan: dict, alt: dict, schema_has_budget: bool) -> dict | None:
    """The searched plan rewritten as `alt` (no agoq: every kind at 16), or None when agoq train cannot run it."""
    budget = alt.get("activation_memory_budget")
    if budget is not None and not schema_has_budget:
        return None
    from agoq.formats.plan import Alternative, plan_from_dict
    from agoq.search.plan_builder import alternative_knobs

    data = json.loads(json.dumps(plan))
    data.update(alternative_knobs(plan_from_dict(plan), Alternative.model_validate(alt)))
    predicted = alt.get("predicted") or {}
    data["predicted"] = {"peak_bytes_per_stage": [predicted.get("peak_bytes")] if predicted.get("peak_bytes") else [],
                         "activation_bytes_per_stage": [], "step_seconds": predicted.get("step_seconds"),
                         "grad_error": 0.0}
    data.update(alternative=None, alternatives=[], decision=None, measured=None)
    from agoq.search.plan_builder import dims_for

    dims = plan_dims(plan)  # the plan's ranks; the alternative's own layout over them: DDP or FSDP2
    processes = 1 if dims is None else dims.world_size
    data["parallel"] = dims_for(int(data["pipeline"]["stages"]), "bf16", processes,
                                alt.get("layout") or "replicated").to_dict()
    data.pop("launch", None)  # derived from the dims on load
    data["source"] = {**data["source"], "method": "alternative", "objective": alt["name"]}
    return data


def train(model: str, plan_path: Path, run_dir: Path, data: str, steps: int, device: str, log: Path) -> dict:
    from experiments.train_runs import launcher

    # the plan's own launch line (agoq.layout.launch_line); over emulated nodes each rank through their wrapper
    start = AGOQ + ["train"] if LAUNCH["nproc"] == 1 else launcher(LAUNCH["nproc"], LAUNCH.get("transport"))
    cmd = start + [model, "--plan", str(plan_path), "--steps", str(steps), "--out", str(run_dir),
                  "--eval-every", str(steps), "--eval-batches", "1", "--checkpoint-every", "0", "--quiet",
                  "--device", device]
    if data:
        cmd += ["--data", data]
    out = run(cmd, log)
    if out["code"] == 0:
        out.update(measured(run_dir))
    return out


def summarise(plan: dict, got: dict, budget: int | None) -> dict:
    """Predicted vs measured and the checks of the module docstring, for a plan or an alternative."""
    predicted = plan.get("predicted") or {}
    peak_p = max(predicted.get("peak_bytes_per_stage") or [0]) or None
    step_p = predicted.get("step_seconds")
    tokens = plan["training"]["micro_batch"] * plan["training"]["grad_accum"] * plan["training"]["seq_len"]
    row = {"predicted_peak_bytes": peak_p, "predicted_step_seconds": step_p,
           "measured": {k: v for k, v in got.items() if k != "tail"}, "failed": got.get("code") != 0}
    if got.get("tail"):
        row["error_tail"] = got["tail"][-1500:]
    if got.get("code") == 0 and got.get("step_seconds"):
        row["measured_tokens_per_second"] = tokens / got["step_seconds"]
        if step_p:
            row["step_error"] = step_p / got["step_seconds"] - 1
        if got.get("peak_bytes") is not None:
            if peak_p:
                row["peak_error"] = peak_p / got["peak_bytes"] - 1
            if budget:
                row["peak_within_budget"] = got["peak_bytes"] <= budget
    return row


def describe(plan: dict) -> dict:
    layers = plan["layers"]
    quantized = sum(1 for lp in layers for s in lp["kinds"].values() if str(s) not in ("16",))
    dims = plan_dims(plan)
    return {"parallel": dims.mode if dims is not None else None, "compile": plan["training"].get("compile"),
            "optimizer": plan.get("optimizer"),
            "gradients": plan["gradients"]["mode"], "micro_batch": plan["training"]["micro_batch"],
            "grad_accum": plan["training"]["grad_accum"], "checkpointed_layers": sum(lp["checkpoint"] for lp in layers),
            "quantized_kinds": quantized,
            "offloaded_layers": [lp["layer"] for lp in layers if lp.get("offload")],
            "predicted_host_bytes": plan["predicted"].get("host_bytes"),
            "distinct_layer_settings": len({json.dumps([lp["checkpoint"], lp["kinds"]], sort_keys=True)
                                            for lp in layers}),
            "decision": (plan.get("decision") or {}).get("reason")}


def chosen_alternatives(plan: dict, fastest: list[dict], always: str) -> list[dict]:
    """The alternatives trained beside `plan`: `fastest` (the fastest fitting ones), then for each prefix of
    `always` (comma-separated) the fastest alternative whose name starts with it, fitting or not, unless one is
    already chosen."""
    chosen = list(fastest)
    for prefix in (p.strip() for p in always.split(",") if p.strip()):
        if any(a["name"].startswith(prefix) for a in chosen):
            continue
        named = sorted((a for a in plan.get("alternatives") or [] if a["name"].startswith(prefix)),
                       key=lambda a: (not a.get("fits"), -((a.get("predicted") or {}).get("tokens_per_second") or 0)))
        chosen += named[:1]
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="probe", help="model preset or config.json, as agoq profile / train take it")
    ap.add_argument("--layers", type=int, default=None, help="profile only this many layers (the model trained is "
                    "then a config.json of that many, written to the work folder)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--profile-args", default="", help="more `agoq profile` flags, e.g. '--bits 4,8 --formats int'")
    ap.add_argument("--profile", default=None, help="reuse this profile folder instead of profiling")
    ap.add_argument("--budgets", type=int, default=8)
    ap.add_argument("--budget-list", default=None, metavar="SIZES",
                    help="comma-separated budgets to plan at instead (e.g. 10.4GB,12GB), after the profile")
    ap.add_argument("--only", default=None, help="comma-separated budget indices to run (default: all)")
    ap.add_argument("--modes", default="default,eager", help="search modes: default, eager (--compile eager)")
    ap.add_argument("--search-args", default="", help="more `agoq search` flags for every budget, e.g. '--master any'")
    ap.add_argument("--alternatives", type=int, default=2, help="fastest fitting alternatives trained per plan")
    ap.add_argument("--always", default="", metavar="PREFIXES",
                    help="comma-separated alternative name prefixes trained beside every plan besides the fastest "
                         "fitting ones, the fastest alternative of each prefix even when it does not fit (e.g. "
                         "'ddp bf16,fsdp bf16' on a cluster: the layouts users run without agoq)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=1, help="train each plan under torchrun in this many processes (the "
                    "profile's world size)")
    ap.add_argument("--transport", choices=("nvlink", "sockets", "nodes"), default="nvlink",
                    help="with --nproc: NCCL over NVLink, or its socket transport on loopback (a network), or "
                         "nodes: the GPUs as nodes of 2 (experiments/emulated_nodes.py), NVLink inside a node and "
                         "the socket between nodes; the profile then runs under torchrun")
    ap.add_argument("--data", default=None, help="text file to train on (default: the built-in synthetic corpus)")
    ap.add_argument("--work", default=None, help="folder for profile, plans and runs (default: a temporary one)")
    ap.add_argument("--name", default=None, help="results name (default plan_accuracy_MODEL)")
    ap.add_argument("--smoke", action="store_true", help="llama-tiny on the CPU, 2 budgets, 3 steps")
    ap.add_argument("--search-only", action="store_true",
                    help="search every budget and list each plan with its fitting alternatives, train nothing (runs "
                         "on the CPU with --profile: which budgets' plans a GPU run would measure)")
    args = ap.parse_args()
    if args.nproc > 1:
        from experiments.train_runs import transport_env

        LAUNCH.update(nproc=args.nproc, env=transport_env(args.transport), transport=args.transport)
    import torch

    from agoq.formats.plan import TrainingSpec

    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.micro_batch, args.seq_len, args.budgets, args.steps = "llama-tiny", 2, 32, 2, 3
        args.profile_args = args.profile_args or "--bits 4,8 --formats int --batches 1"
    elif args.search_only and not args.profile:
        raise SystemExit("--search-only needs --profile (profiling a model for real needs its GPU)")
    elif not torch.cuda.is_available() and not args.search_only:
        raise SystemExit("no GPU: run with --smoke or --search-only on the CPU")
    name = args.name or f"plan_accuracy_{Path(args.model).stem}" + ("_smoke" if args.smoke else "")
    schema_has_budget = "activation_memory_budget" in TrainingSpec.model_fields
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        figures: dict = {"model": args.model, "layers": args.layers, "micro_batch": args.micro_batch,
                         "nproc": args.nproc, "transport": args.transport if args.nproc > 1 else None,
                         "seq_len": args.seq_len, "steps": args.steps, "smoke": args.smoke, "budgets": []}
        model = args.model
        if args.layers:
            from agoq.models import resolve_config

            config = resolve_config(args.model).to_dict()
            config.update(num_hidden_layers=args.layers, name=f"{config.get('name', args.model)}-{args.layers}l")
            model = str(work / "model.json")
            Path(model).write_text(json.dumps(config))
        profile_dir = Path(args.profile) if args.profile else work / "profile"
        if not (profile_dir / "profile.json").exists():
            cmd = AGOQ + ["profile", args.model, "--device", device, "--out", str(profile_dir), "--quiet",
                          "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len)]
            cmd += (["--layers", str(args.layers)] if args.layers else []) + args.profile_args.split()
            if args.nproc > 1 and args.transport == "nodes":  # each rank in its node: under torchrun
                from experiments.train_runs import launcher

                cmd = launcher(args.nproc, "nodes", "agoq.cli") + cmd[len(AGOQ):]
            elif args.nproc > 1 and "--world-size" not in cmd:  # the ranks the plans run on, their layout steps
                cmd += ["--world-size", str(args.nproc)]
            figures["profile_run"] = run(cmd, work / "profile.log")
            if figures["profile_run"]["code"]:
                write_result(name, figures)
                raise SystemExit("agoq profile failed")
        figures["profile"] = str(profile_dir)
        points, bounds = budgets(profile_dir, args.budgets)
        if args.budget_list:
            from agoq.units import parse_size

            points = [parse_size(b) for b in args.budget_list.split(",")]
        figures.update(bounds)
        only = {int(i) for i in args.only.split(",")} if args.only else set(range(len(points)))
        for index, budget in enumerate(points):
            if index not in only:
                continue
            for mode in args.modes.split(","):
                tag = f"b{index}-{mode}"
                plan_path = work / f"{tag}.json"
                cmd = AGOQ + ["search", "--profile", str(profile_dir), "--budget", str(budget), "--out",
                              str(plan_path), "--quiet"] + (["--compile", "eager"] if mode == "eager" else []) \
                    + args.search_args.split()
                searched = run(cmd, work / f"{tag}.search.log")
                entry = {"index": index, "mode": mode, "budget_bytes": budget, "search": searched}
                figures["budgets"].append(entry)
                if searched["code"]:
                    write_result(name, figures)
                    continue
                plan = json.loads(plan_path.read_text())
                entry["plan"] = describe(plan)
                if args.search_only:
                    entry["plan"].update({k: v for k, v in summarise(plan, {}, budget).items()
                                          if k not in ("measured", "failed")})
                    entry["alternatives"] = [
                        {"name": a["name"], "fits": a.get("fits"), **{k: (a.get("predicted") or {}).get(k) for k in (
                            "tokens_per_second", "peak_bytes", "step_seconds")}}
                        for a in plan.get("alternatives") or []]
                    p = entry["plan"]
                    print(f"[{tag}] budget {budget / 1e9:.3f} GB: {p['compile']} {p['gradients']} "
                          f"{p['micro_batch']}x{p['grad_accum']} {p['optimizer']}, {p['checkpointed_layers']} "
                          f"checkpointed, {p['quantized_kinds']} quantized, offloaded {p['offloaded_layers']}: "
                          f"{(p.get('predicted_step_seconds') or 0) * 1e3:.1f} ms, "
                          f"{(p.get('predicted_peak_bytes') or 0) / 1e9:.3f} GB", flush=True)
                    path = write_result(name, figures)
                    continue
                entry["plan"].update(summarise(plan, train(model, plan_path, work / tag, args.data, args.steps, device,
                                                           work / f"{tag}.train.log"), budget))
                fitting = sorted((a for a in plan.get("alternatives") or [] if a.get("fits")),
                                 key=lambda a: -((a.get("predicted") or {}).get("tokens_per_second") or 0))
                entry["alternatives"] = []
                for k, alt in enumerate(chosen_alternatives(plan, fitting[:args.alternatives], args.always)):
                    data = alternative_plan(plan, alt, schema_has_budget)
                    row = {"name": alt["name"], "fits": alt.get("fits"), "predicted_tokens_per_second": (alt.get("predicted") or {}).get(
                        "tokens_per_second")}
                    if data is None:
                        row["skipped"] = "agoq train cannot run torch.compile's activation_memory_budget from a plan"
                    else:
                        alt_path = work / f"{tag}-alt{k}.json"
                        alt_path.write_text(json.dumps(data))
                        row.update(summarise(data, train(model, alt_path, work / f"{tag}-alt{k}", args.data,
                                                         args.steps, device, work / f"{tag}-alt{k}.train.log"), budget))
                    entry["alternatives"].append(row)
                best = max((a.get("measured_tokens_per_second") or 0 for a in entry["alternatives"]
                            if a.get("fits")), default=0)  # an alternative over the budget is shown, not compared
                mine = entry["plan"].get("measured_tokens_per_second")
                if best and mine:
                    entry["plan_vs_fastest_alternative"] = mine / best
                p = entry["plan"]
                print(f"[{tag}] budget {budget / 1e9:.3f} GB: plan {p.get('measured', {}).get('step_seconds', 0) * 1e3:.1f}"
                      f" ms (predicted {(p.get('predicted_step_seconds') or 0) * 1e3:.1f}), peak "
                      f"{(p.get('measured', {}).get('peak_bytes') or 0) / 1e9:.3f} GB (predicted "
                      f"{(p.get('predicted_peak_bytes') or 0) / 1e9:.3f}); vs fastest alternative "
                      f"{entry.get('plan_vs_fastest_alternative', float('nan')):.3f}x", flush=True)
                figures["wall_seconds"] = time.perf_counter() - started
                path = write_result(name, figures)
    print("wrote", path)


if __name__ == "__main__":
    main()
