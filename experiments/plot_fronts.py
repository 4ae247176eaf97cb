"""The memory/time fronts of torch.compile's own activation savers and of agoq's, from bench_compile results.

Reads experiments/results/bench_compile*.json (written by experiments/bench_compile.py on one GPU) and, per model,
puts every compiled variant at (memory above weights in GiB, step time / compiled bf16's step in the same run).
Two systems: compile's ("compiled-bf16", "compiled-budgetB", "compiled-checkpoint") and agoq's ("compiled-fused-
bf16", "compiled-agoq-paper", "compiled-int8", "compiled-int4"); each system's Pareto front (no other point of the
system both smaller and faster) is drawn as a step line. Several result files of one model are merged, each
variant's ratio taken against the compiled bf16 of its own file. For each point of compile's front the table
gives agoq's fastest point at equal or lower memory and the speed-up.

    python experiments/plot_fronts.py      # no GPU: reads the committed results
Writes experiments/results/fronts_MODEL.html (plotly, the library loaded from its CDN) and fronts.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COMPILE = ("compiled-bf16", "compiled-budget", "compiled-checkpoint")
AGOQ = ("compiled-fused-bf16", "compiled-agoq-paper", "compiled-int8", "compiled-int4")


def system(variant: str):
    if variant.startswith(AGOQ):
        return "agoq"
    if variant.startswith(COMPILE):
        return "torch.compile"
    return None


def points_by_model(files) -> dict:
    """{model: {variant: {"memory_GiB", "step_ratio", "step_ms", "file"}}}; a variant in several files keeps the
    first file's figures (files in name order: bench_compile.json before bench_compile_rest.json)."""
    out: dict = {}
    for path in files:
        figures = json.loads(path.read_text())["figures"]
        variants = figures["variants"]
        base = variants.get("compiled-bf16")
        if not base or not base.get("step_ms"):
            continue  # no reference in this run: its ratios would compare runs
        model = f"{figures['model']}-{figures['layers']}l"
        for name, v in variants.items():
            if system(name) is None or not v.get("step_ms") or name in out.get(model, {}):
                continue
            out.setdefault(model, {})[name] = {"memory_GiB": v["memory_above_weights_GiB"],
                                               "step_ratio": v["step_ms"] / base["step_ms"], "step_ms": v["step_ms"],
                                               "system": system(name), "file": path.name}
    return out


def front(points: dict) -> list[str]:
    """Names of the Pareto-optimal points (by memory, then step ratio), smallest memory first."""
    kept, best = [], float("inf")
    for n in sorted(points, key=lambda n: (points[n]["memory_GiB"], points[n]["step_ratio"])):
        if points[n]["step_ratio"] < best - 1e-12:
            kept.append(n)
            best = points[n]["step_ratio"]
    return kept


def compare(points: dict) -> list[dict]:
    """At each point of compile's front: agoq's fastest point at equal or lower memory, and its speed-up."""
    compile_pts = {n: p for n, p in points.items() if p["system"] == "torch.compile"}
    agoq_pts = {n: p for n, p in points.items() if p["system"] == "agoq"}
    rows = []
    for n in front(compile_pts):
        p = compile_pts[n]
        fits = [m for m, q in agoq_pts.items() if q["memory_GiB"] <= p["memory_GiB"] * (1 + 1e-3)]
        best = min(fits, key=lambda m: agoq_pts[m]["step_ratio"]) if fits else None
        rows.append({"compile_point": n, "memory_GiB": p["memory_GiB"], "step_ratio": p["step_ratio"],
                     "agoq_point": best, "agoq_memory_GiB": agoq_pts[best]["memory_GiB"] if best else None,
                     "agoq_step_ratio": agoq_pts[best]["step_ratio"] if best else None,
                     "speedup": p["step_ratio"] / agoq_pts[best]["step_ratio"] if best else None})
    return rows


def plot(model: str, points: dict, path: Path) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, colour in (("torch.compile", "#1f77b4"), ("agoq", "#d62728")):
        pts = {n: p for n, p in points.items() if p["system"] == name}
        fig.add_trace(go.Scatter(x=[p["memory_GiB"] for p in pts.values()], y=[p["step_ratio"] for p in pts.values()],
                                 mode="markers+text", text=[n.replace("compiled-", "") for n in pts],
                                 textposition="top center", name=name, marker={"color": colour, "size": 9}))
        f = front(pts)
        fig.add_trace(go.Scatter(x=[pts[n]["memory_GiB"] for n in f], y=[pts[n]["step_ratio"] for n in f],
                                 mode="lines", line={"shape": "hv", "color": colour}, name=f"{name} front"))
    fig.update_layout(title=f"{model}: step time against memory above weights (one GPU, compiled per layer)",
                      xaxis_title="memory above weights (GiB)", yaxis_title="step time / compiled bf16's")
    tmp = path.with_suffix(".html.tmp")
    fig.write_html(tmp, include_plotlyjs="cdn")
    tmp.replace(path)


def main() -> None:
    files = sorted(RESULTS.glob("bench_compile*.json"))
    if not files:
        raise SystemExit(f"no bench_compile results in {RESULTS}: run experiments/bench_compile.py on a GPU first")
    out = {}
    for model, points in points_by_model(files).items():
        plot(model, points, RESULTS / f"fronts_{model}.html")
        rows = compare(points)
        out[model] = {"points": points, "compile_front": front({n: p for n, p in points.items()
                                                                if p["system"] == "torch.compile"}),
                      "agoq_front": front({n: p for n, p in points.items() if p["system"] == "agoq"}),
                      "agoq_at_compile_points": rows}
        print(model)
        for r in rows:
            agoq = (f"{r['agoq_point']} {r['agoq_memory_GiB']:.2f} GiB {r['agoq_step_ratio']:.3f}x: "
                    f"speed-up {r['speedup']:.3f}") if r["agoq_point"] else "nothing of agoq at this memory"
            print(f"  {r['compile_point']:>22s} {r['memory_GiB']:5.2f} GiB {r['step_ratio']:.3f}x | {agoq}")
    print("wrote", write_result("fronts", {"source_files": [f.name for f in files], "models": out}))


if __name__ == "__main__":
    main()
