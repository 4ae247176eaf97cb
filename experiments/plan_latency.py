"""How long one plan request takes, across the budget range: what `POST /api/plan` and `agoq search` wait for.

The planner's search (agoq.search.search with the service's fixed options: MILP, no front, no validation) on a
profile of the probe model's shapes (16 layers x 7 kinds, micro-batch 2 x 4096, synthetic sensitivities and
times: tests/search/synthetic_profile.py), under the default objective (most tokens/s within the recipe's
error cap), at budgets from the smallest that meets the cap to the largest useful one (agoq.search.knobs.budget_bounds).
The tight end is the hard one: the error cap and the memory budget both bind.

Each budget is solved as the service does, and again with every knob combination solved
(agoq.search.knobs.solve_knobs(prune=False): no dominance or relaxation bound skips any), the reference the
bounded search must equal and beat. Then a budget of half the smallest, which nothing fits: the answer is the
smallest budget that fits (agoq.search.knobs.least_budget), as `agoq search` and the service give it. The budget
range itself (agoq.search.knobs.budget_bounds, what the dashboard's slider spans) is timed once. CPU only; the
service solves on the CPU.

    python experiments/plan_latency.py                 # about 2 minutes on 2 cores
    python experiments/plan_latency.py --profile experiments/results/profiles/probe-h200-1125 --name plan_latency_probe_h200
                                                       # a real GPU profile instead of the synthetic one
    python experiments/plan_latency.py --profile experiments/results/profiles/probe-h200-link --no-every --cli \
        --name plan_latency_probe_h200_link            # with its host link (offload offered), and `agoq search` too
    python experiments/plan_latency.py --profile ... --no-every --toggle agoq.search.knobs:BINDING_BESIDE
                                                       # each request with a switch on and off, in one process
Writes experiments/results/NAME.json (default plan_latency).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402

FRACTIONS = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0)  # of the way from the smallest to the largest budget


def default_range(profile) -> tuple[int, int, float]:
    """(the smallest budget the default search fits, under the recipe's error cap; the largest useful budget;
    that error cap): the range the default objective plans over, bytes."""
    from agoq.search import knobs as knob_search
    from agoq.search.request import DEFAULT_ERROR_CAP, InfeasibleBudget
    from agoq.search.search import _recipe_cap

    t = time.perf_counter()
    least, largest = knob_search.budget_bounds(profile)  # the smallest with no caps
    default_range.budget_bounds_seconds = time.perf_counter() - t  # the dashboard's budget range, once a profile
    cap = _recipe_cap(profile, DEFAULT_ERROR_CAP, [])
    try:  # the smallest under the recipe's error cap: where the range starts for the default objective
        knob_search.solve_knobs(profile, least, error_cap=cap)
    except InfeasibleBudget as e:
        least = e.smallest_budget
    return least, largest, cap


def infeasible(args, profile, folder: Path, least: int, fixed: dict, tmp: Path) -> dict:
    """A budget of half the smallest that fits: nothing fits, and the answer names the smallest budget that does
    (InfeasibleBudget; `agoq search` exits 2 with that message). Timed as a request and, with --cli, as a process."""
    from agoq.search.request import InfeasibleBudget
    from agoq.search.search import search

    budget, times, answered = least // 2, [], set()
    for _ in range(args.repeats):
        t = time.perf_counter()
        try:
            search(profile, budget, **fixed)
        except InfeasibleBudget as e:
            answered.add(e.smallest_budget)
        else:
            raise SystemExit(f"a plan fitted {budget} bytes, half the smallest budget {least}")
        times.append(time.perf_counter() - t)
    row = {"budget_bytes": budget, "request_seconds_median": statistics.median(times), "request_seconds_all": times,
           "smallest_budget_answered": sorted(answered)}
    if args.cli:
        runs = []
        for _ in range(args.repeats):
            cmd = [sys.executable, "-m", "agoq.cli", "search", "--profile", str(folder), "--budget", str(budget),
                   "--out", str(tmp / "cli" / "refused.json"), "--quiet"]
            t = time.perf_counter()
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  cwd=Path(__file__).resolve().parent.parent)
            runs.append(time.perf_counter() - t)
            if done.returncode != 2:
                raise SystemExit(f"agoq search at {budget} bytes exited {done.returncode}, not 2 (nothing fits)")
        row.update(agoq_search_seconds_median=statistics.median(runs), agoq_search_seconds_all=runs)
    print(f"budget {budget / 2**30:7.2f} GiB (nothing fits): request {row['request_seconds_median']:6.2f} s"
          + (f", agoq search {row['agoq_search_seconds_median']:6.2f} s" if args.cli else "")
          + f"; answered the smallest budget {row['smallest_budget_answered']}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="probe", help="model whose shapes the synthetic profile has (default probe)")
    ap.add_argument("--repeats", type=int, default=2, help="solves per budget (the median is reported)")
    ap.add_argument("--profile", default=None, help="a profile folder to plan from (default: the synthetic one)")
    ap.add_argument("--every", action=argparse.BooleanOptionalAction, default=True,
                    help="also solve every combination at each budget (the reference; slow on real profiles)")
    ap.add_argument("--cli", action=argparse.BooleanOptionalAction, default=False,
                    help="also time `agoq search` with its defaults at each budget, as a whole process (imports, the "
                         "front and the files included; the median of --repeats runs)")
    ap.add_argument("--toggle", default=None, metavar="MODULE:FLAG",
                    help="a module's boolean switch (e.g. agoq.search.knobs:BINDING_BESIDE): each request is made with "
                         "it on and off, alternately and in turn first, in this one process (the machine's drift "
                         "between runs cancels); the median of each is reported")
    ap.add_argument("--name", default="plan_latency")
    args = ap.parse_args()
    switch = None
    if args.toggle:
        import importlib

        module_name, _, flag = args.toggle.partition(":")
        try:
            switch = (importlib.import_module(module_name), flag)
        except ImportError as e:
            ap.error(f"--toggle {args.toggle}: cannot import {module_name} ({e})")
        if not isinstance(getattr(switch[0], flag, None), bool):
            ap.error(f"--toggle {args.toggle}: {module_name} has no boolean {flag!r}")
    from agoq.formats.profile import load_profile
    from agoq.search import knobs as knob_search
    from agoq.search.search import search
    from tests.search.synthetic_profile import write_profile

    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            folder = Path(args.profile)
        else:
            folder = write_profile(Path(tmp) / "profile", random.Random(7), model=args.model, micro_batch=2,
                                   seq_len=4096)
        profile = load_profile(folder)
        least, largest, cap = default_range(profile)
        fixed = {"method": "milp", "front_budgets": 0, "validate": 0, "progress": False}
        rows = []
        for frac in FRACTIONS:
            budget = int(least + frac * (largest - least))
            times, plan, off = [], None, []
            for i in range(args.repeats):
                for on in ((True, False) if i % 2 == 0 else (False, True)) if switch else (True,):
                    if switch:
                        setattr(*switch, on)
                    t = time.perf_counter()
                    found = search(profile, budget, **fixed).plan
                    (times if on else off).append(time.perf_counter() - t)
                    plan = found if on else plan
            if switch:
                setattr(*switch, True)
            row = {"budget_fraction": frac, "budget_bytes": budget, "request_seconds_median": statistics.median(times),
                   "request_seconds_all": times, "tokens_per_second": plan.decision.tokens_per_second,
                   "plan_agoq": plan.decision.agoq}
            if switch:
                row.update(request_seconds_median_toggled_off=statistics.median(off),
                           request_seconds_all_toggled_off=off)
            if args.cli:
                runs = []
                for _ in range(args.repeats):
                    cmd = [sys.executable, "-m", "agoq.cli", "search", "--profile", str(folder), "--budget",
                           str(budget), "--out", str(Path(tmp) / "cli" / "plan.json"), "--quiet"]
                    t = time.perf_counter()
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   cwd=Path(__file__).resolve().parent.parent)
                    runs.append(time.perf_counter() - t)
                row["agoq_search_seconds_median"] = statistics.median(runs)
                row["agoq_search_seconds_all"] = runs
            if args.every:
                t = time.perf_counter()
                every = knob_search.solve_knobs(profile, budget, error_cap=cap, prune=False)
                row["every_combination_seconds"] = time.perf_counter() - t
                row["every_combination_tokens_per_second"] = every.best.tokens_per_second
            rows.append(row)
            print(f"budget {budget / 2**30:7.2f} GiB ({frac:4.2f}): request {row['request_seconds_median']:6.2f} s"
                  + (f" ({args.toggle} off: {row['request_seconds_median_toggled_off']:6.2f} s)" if switch else "")
                  + (f", agoq search {row['agoq_search_seconds_median']:6.2f} s" if args.cli else "")
                  + (f", every combination solved {row['every_combination_seconds']:6.2f} s" if args.every else ""),
                  flush=True)
        rows_infeasible = infeasible(args, profile, folder, least, fixed, Path(tmp))
    figures = {"model": args.model,
               "profile": args.profile or "synthetic (tests/search/synthetic_profile.py, seed 7)",
               "error_cap": cap, "smallest_budget_bytes": least, "largest_budget_bytes": largest, "budgets": rows,
               "worst_request_seconds": max(r["request_seconds_median"] for r in rows),
               "budget_bounds_seconds": default_range.budget_bounds_seconds, "infeasible": rows_infeasible,
               "cpu_count": os.cpu_count(), "load_average_1_5_15min_at_end": list(os.getloadavg()),
               "target_request_seconds": 1.0, **({"toggle": args.toggle} if switch else {}),
               **({"worst_agoq_search_seconds": max(r["agoq_search_seconds_median"] for r in rows),
                   "target_agoq_search_seconds": 10.0} if args.cli else {})}
    print("wrote", write_result(args.name, figures))


if __name__ == "__main__":
    main()
