"""How a step's time grows with the number of offloaded layers: a fixed cost per step, a cost per layer, or both.

The profile measures one offloading step (its first L - 1 layers offloaded) beside the same step kept, and the
search charges the difference, less what its link model prices, per offloaded layer (agoq.search.costs
offload_prices). Plans that offload fewer layers would then be charged too little if part of the difference is
paid once per step. This script measures the profile's own kinds of step (`agoq train`'s code, in this process, as
`agoq profile` measures them: agoq.commands.profile_steps) at several offloaded prefixes K, each pass in the other
order, and fits

    T(K) = T(0) + fixed x [K > 0] + per_layer x K

by least squares over K > 0 for each kind of step. Writes experiments/results/NAME.json with every pass's median.

    python experiments/offload_layers.py --model probe --layers-offloaded 0,1,2,4,8,15 --name offload_layers_probe_h100
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoq.commands.profile_steps import BASE, train_settings  # noqa: E402
from agoq.train.config import TrainConfig  # noqa: E402
from agoq.train.measure import measure_steps  # noqa: E402
from experiments.record import write_result  # noqa: E402


def kinds(args) -> list[dict]:
    """Every (compile mode, micro-batch x accumulation, gradients) of --steps-of, at every K of --layers-offloaded."""
    out = []
    for spec in args.steps_of.split(","):
        mode, shape, gradients = spec.split(":")
        m, a = (int(v) for v in shape.split("x"))
        for k in (int(v) for v in args.layers_offloaded.split(",")):
            kind = {"compile": mode, "policy": "agoq-paper", "micro_batch": m, "grad_accum": a, **BASE,
                    "gradients": gradients, "activation_memory_budget": None}
            if k:
                kind["offload_layers"] = k
            out.append(kind)
    return out


def fit(points: dict[int, float]) -> dict:
    """T(K) = T(0) + fixed [K > 0] + per_layer K over the K > 0 points (least squares), with T(0) measured."""
    t0 = points.get(0)
    ks = sorted(k for k in points if k > 0)
    if t0 is None or len(ks) < 2:
        return {}
    a = np.array([[1.0, k] for k in ks])
    y = np.array([points[k] - t0 for k in ks])
    (fixed, per_layer), *_ = np.linalg.lstsq(a, y, rcond=None)
    residual = y - a @ np.array([fixed, per_layer])
    return {"fixed_seconds": float(fixed), "per_layer_seconds": float(per_layer),
            "largest_residual_seconds": float(np.abs(residual).max()),
            "per_layer_if_no_fixed_seconds": float((points[ks[-1]] - t0) / ks[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="probe")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=25, help="optimizer steps per kind and pass (the first is warm-up)")
    ap.add_argument("--passes", type=int, default=2, help="passes over every kind, each in the other order")
    ap.add_argument("--layers-offloaded", default="0,1,2,4,8,15", help="the offloaded prefixes K to measure")
    ap.add_argument("--steps-of", default="compiled:1x2:bf16,compiled:2x1:bf16,compiled:1x2:quangrad8",
                    help="kinds of step, MODE:MICROxACCUM:GRADIENTS, comma-separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--name", required=True)
    args = ap.parse_args()

    todo = kinds(args)
    medians: list[list[float]] = [[] for _ in todo]
    peaks: list[list[int]] = [[] for _ in todo]
    offloaded: list[int] = [0] * len(todo)
    for p in range(args.passes):
        order = range(len(todo)) if p % 2 == 0 else range(len(todo) - 1, -1, -1)
        for i in order:
            kind = todo[i]
            cfg = TrainConfig(**train_settings(kind, args.model, args.seq_len, "bf16", args.device, args.steps, 0))
            figures = measure_steps(cfg)
            steady = figures.seconds[1:]
            medians[i].append(statistics.median(steady))
            peaks[i].append(int(max(figures.peak_bytes)) if figures.peak_bytes else None)  # None on a CPU
            offloaded[i] = int(figures.offloaded_bytes or 0)
            print(f"pass {p} {kind['compile']} {kind['micro_batch']}x{kind['grad_accum']} {kind['gradients']} "
                  f"K={kind.get('offload_layers', 0)}: {medians[i][-1] * 1e3:.1f} ms, peak {peaks[i][-1]}",
                  flush=True)
    rows, by_step = [], {}
    for i, kind in enumerate(todo):
        k = int(kind.get("offload_layers", 0))
        mean = statistics.fmean(medians[i])
        rows.append({**kind, "offload_layers": k, "pass_median_seconds": medians[i], "seconds": mean,
                     "peak_bytes": max(p for p in peaks[i] if p is not None) if any(peaks[i]) else None,
                     "offloaded_bytes_per_micro_batch": offloaded[i]})
        key = f"{kind['compile']} {kind['micro_batch']}x{kind['grad_accum']} {kind['gradients']}"
        by_step.setdefault(key, {})[k] = mean
    fits = {key: {"seconds_by_layers": {str(k): v for k, v in sorted(points.items())}, **fit(points)}
            for key, points in by_step.items()}
    for key, f in fits.items():
        if "fixed_seconds" in f:
            print(f"{key}: fixed {f['fixed_seconds'] * 1e3:.2f} ms + {f['per_layer_seconds'] * 1e3:.3f} ms a layer "
                  f"(residual up to {f['largest_residual_seconds'] * 1e3:.2f} ms; all per layer: "
                  f"{f['per_layer_if_no_fixed_seconds'] * 1e3:.3f} ms)")
    path = write_result(args.name, {"model": args.model, "seq_len": args.seq_len, "steps": args.steps,
                                    "passes": args.passes, "rows": rows, "fits": fits})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
