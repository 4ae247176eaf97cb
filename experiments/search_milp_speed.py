"""How fast the exact per-layer choice is: MILP on 80 layers x 6 kinds x 9 options (+ whole-layer
checkpointing), one budget and the whole memory/error Pareto front (20 budgets). CPU only.

Bytes are the runtime's exact predictions for the probe model's layer shape (micro-batch 2 x 4096 tokens,
bf16), sensitivities and times are random (log-uniform, falling with bits), so the instance has the size
and structure of a real one. Targets: one solve <= 2 s, the front <= 30 s on a 2-core CPU.

    python experiments/search_milp_speed.py [--layers 80] [--stages 1,4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes  # noqa: E402
from agoq.runtime.activations.policy import KINDS  # noqa: E402
from agoq.models import resolve_config  # noqa: E402
from agoq.search.costs import ChoiceProblem  # noqa: E402
from agoq.search.milp import Solver, resolve_time_cap  # noqa: E402
from agoq.search.pareto import memory_error_front  # noqa: E402
from experiments.record import write_result  # noqa: E402

OPTIONS = ["16", "8", "7", "6", "5", "4", "3", "2", "recompute"]  # 9 per kind
SIX_KINDS = [k for k in KINDS if k != "o_proj_input"]


def instance(layers: int, stages: int, seed: int) -> ChoiceProblem:
    rng = random.Random(seed)
    shape = LayerShape.from_config(resolve_config("probe"), 2, 4096, 2)
    layer, kind, option, memory, seconds, error = [], [], [], [], [], []
    stage_of = np.array([l * stages // layers for l in range(layers)])
    in_flight = [stages - s for s in range(stages)]
    for l in range(layers):
        flight = in_flight[stage_of[l]]
        for k in SIX_KINDS:
            full = predict_layer_bytes(shape, {**{x: 8 for x in KINDS}, k: 16})[k]
            base_err = math.exp(rng.uniform(math.log(1e-3), math.log(0.2)))
            for o in OPTIONS:
                layer.append(l)
                kind.append(KINDS.index(k))
                option.append(o)
                if o == "16":
                    memory.append(full * flight), seconds.append(0.0), error.append(0.0)
                elif o == "recompute":
                    memory.append(0.0), seconds.append(rng.uniform(2e-4, 1e-3)), error.append(0.0)
                else:
                    b = int(o)
                    memory.append(math.ceil(full * b / 16 * 1.02) * flight)
                    seconds.append(rng.uniform(2e-5, 1.5e-4))
                    error.append(base_err * 2.0 ** (4 - b) * rng.uniform(0.8, 1.25))
    hidden = shape.tokens * shape.hidden * 2
    return ChoiceProblem(
        np.array(layer), np.array(kind), option, np.array(memory, float), np.array(seconds), np.array(error),
        stage_of, np.array([hidden * in_flight[stage_of[l]] for l in range(layers)], float),
        np.full(layers, 0.0021), True, np.zeros(layers), np.zeros(layers),
        np.full(stages, 8 * 2**30, dtype=float), 0.101, in_flight=np.array(in_flight, dtype=float),
        recompute_bytes=np.full(layers, float(sum(predict_layer_bytes(shape, None).values()))))


def measure(layers: int, stages: int, repeats: int, seed: int) -> dict:
    problem = instance(layers, stages, seed)
    t0 = time.perf_counter()
    solver = Solver(problem)
    build = time.perf_counter() - t0
    low = solver.smallest_budget()
    high = max(solver.solve(math.inf).peak_bytes_per_stage)
    rng = random.Random(seed + 1)
    singles, capped = [], []
    for _ in range(repeats):
        budget = low + rng.uniform(0.2, 0.8) * (high - low)
        t = time.perf_counter()
        solver.solve(budget, "error")
        singles.append(time.perf_counter() - t)
        t = time.perf_counter()
        solver.solve(budget, "error", resolve_time_cap(problem, budget, "checkpoint"))
        capped.append(time.perf_counter() - t)
    t = time.perf_counter()
    front = memory_error_front(problem, 20, "error", None, Solver(problem))
    front_seconds = time.perf_counter() - t
    t = time.perf_counter()
    front_capped = memory_error_front(problem, 20, "error", lambda b: resolve_time_cap(problem, b, "checkpoint"),
                                      Solver(problem))
    front_capped_seconds = time.perf_counter() - t
    return {"layers": layers, "kinds": len(SIX_KINDS), "options_per_kind": len(OPTIONS), "stages": stages,
            "variables": len(problem.option) + 3 * layers, "matrix_build_seconds": build,
            "solve_seconds_median": statistics.median(singles), "solve_seconds_max": max(singles),
            "solve_with_checkpoint_cap_seconds_median": statistics.median(capped),
            "solve_with_checkpoint_cap_seconds_max": max(capped),
            "front_20_budgets_seconds": front_seconds, "front_points": len(front),
            "front_20_budgets_with_checkpoint_cap_seconds": front_capped_seconds,
            "front_capped_points": len(front_capped),
            "smallest_budget_bytes": low, "unconstrained_peak_bytes": high,
            "target_solve_seconds": 2.0, "target_front_seconds": 30.0,
            "met": max(singles) <= 2.0 and front_seconds <= 30.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--stages", default="1,4", help="pipeline stage counts to try (default 1,4)")
    parser.add_argument("--repeats", type=int, default=5, help="single solves timed (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="search_milp_speed", help="result name (experiments/results/NAME.json)")
    args = parser.parse_args()
    runs = []
    print(f"load average before: {os.getloadavg()}")
    for stages in [int(s) for s in args.stages.split(",")]:
        r = measure(args.layers, stages, args.repeats, args.seed)
        runs.append(r)
        print(f"{stages} stage(s): one solve {r['solve_seconds_median']:.3f} s median, {r['solve_seconds_max']:.3f} s "
              f"max ({r['solve_with_checkpoint_cap_seconds_max']:.3f} s with the checkpoint time cap); "
              f"front of 20 budgets {r['front_20_budgets_seconds']:.2f} s "
              f"({r['front_20_budgets_with_checkpoint_cap_seconds']:.2f} s capped); met: {r['met']}")
    figures = {"cpu_count": os.cpu_count(), "load_average_1_5_15min_at_end": list(os.getloadavg()),
               "note": "times are wall-clock on a CPU shared with other processes (see the load average)",
               "runs": runs}
    path = write_result(args.name, figures)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
