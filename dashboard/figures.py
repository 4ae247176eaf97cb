"""Plotly figures (as plain JSON-ready dicts) built from the data the API returns."""

from __future__ import annotations

import json
import math
from typing import Any

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22")
BASE_LAYOUT = {"margin": {"l": 70, "r": 30, "t": 50, "b": 60}, "template": "plotly_white", "height": 420,
               "legend": {"orientation": "h", "y": -0.2}}


def byte_unit(largest: float | None) -> tuple[str, float]:
    """A readable binary unit for byte values up to `largest`: (name, bytes per unit)."""
    for name, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if largest is not None and largest >= size:
            return name, size
    return "B", 1.0


def _scaled(values: list, size: float) -> list:
    return [None if v is None else v / size for v in values]


def _figure(data: list[dict], title: str, **layout: Any) -> dict[str, Any]:
    import plotly.graph_objects as go

    fig = go.Figure(data=data, layout={**BASE_LAYOUT, "title": {"text": title}, **layout})
    return json.loads(fig.to_json())


def heat_map(z: list[list], x: list, y: list, title: str, colorbar: str, text: list[list] | None = None,
             **trace: Any) -> dict[str, Any]:
    """A heat map, rows y (layers) by columns x (kinds)."""
    ticks = {k[len("colorbar_"):]: trace.pop(k) for k in list(trace) if k.startswith("colorbar_")}
    spec = {"type": "heatmap", "z": z, "x": x, "y": y, "colorbar": {"title": {"text": colorbar}, **ticks},
            "hoverongaps": False, **trace}
    if text is not None:
        spec.update(text=text, texttemplate="%{text}")
    return _figure([spec], title, xaxis={"title": {"text": "tensor kind"}, "type": "category"},
                   yaxis={"title": {"text": "layer"}, "type": "category", "autorange": "reversed"},
                   height=max(320, 26 * len(y) + 160))


def profile_maps(maps: dict[str, Any]) -> list[dict[str, Any]]:
    """Sensitivity and bytes heat maps of a profile at the chosen option."""
    option = maps["option"]
    bytes_max = max((v for row in maps["bytes"] for v in row if v is not None), default=None)
    unit, size = byte_unit(bytes_max)
    sens = maps["sensitivity"]
    positive = [v for row in sens for v in row if v is not None and v > 0]
    title = f"Sensitivity at option {option}: weight-gradient error when only this tensor uses it"
    if positive and max(positive) / min(positive) > 100:
        # spans decades: colour by log10, label the colour bar in plain numbers, hover the raw value
        lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
        z = [[math.log10(v) if v is not None and v > 0 else None for v in row] for row in sens]
        sens_map = heat_map(z, maps["kinds"], maps["layers"], title + " (log colour scale)", "rel. L2",
                            colorscale="Viridis", customdata=sens, zmin=lo, zmax=hi,
                            hovertemplate="layer %{y}, %{x}<br>sensitivity %{customdata:.3g}<extra></extra>")
        sens_map["data"][0]["colorbar"].update(tickvals=list(range(lo, hi + 1)),
                                               ticktext=[f"1e{k}" for k in range(lo, hi + 1)])
    else:
        sens_map = heat_map(sens, maps["kinds"], maps["layers"], title, "rel. L2", colorscale="Viridis")
    return [
        sens_map,
        heat_map([_scaled(r, size) for r in maps["bytes"]], maps["kinds"], maps["layers"],
                 f"Bytes kept per micro-batch at option {option}", unit, colorscale="Blues"),
    ]


def error_curves(curves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean tensor error and mean gradient sensitivity against bit width, one line per kind."""
    figs = []
    for key, title in (("quant_error", "Tensor error vs bit width (mean over layers)"),
                       ("sensitivity", "Weight-gradient sensitivity vs bit width (mean over layers)")):
        data = []
        for i, c in enumerate(curves):
            label = c["kind"] + ("" if c["format"] == "int" else f" ({c['format']})")
            data.append({"type": "scatter", "mode": "lines+markers", "name": label, "x": c["bits"], "y": c[key],
                         "line": {"color": PALETTE[i % len(PALETTE)]}})
        figs.append(_figure(data, title, xaxis={"title": {"text": "bits"}, "dtick": 1},
                            yaxis={"title": {"text": "relative L2 error"}, "type": "log"}))
    return figs


def collective_times(series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collective time against message size, log-log: one chart per operation, one line per
    (path, world size)."""
    figs = []
    for op in dict.fromkeys(s["op"] for s in series):
        data = []
        for i, s in enumerate(x for x in series if x["op"] == op):
            data.append({"type": "scatter", "mode": "lines+markers", "name": f"{s['path']} (x{s['world_size']})",
                         "x": s["message_bytes"], "y": [None if v is None else v * 1e3 for v in s["seconds"]],
                         "line": {"color": PALETTE[i % len(PALETTE)]}})
        figs.append(_figure(data, f"{op}: time vs message size",
                            xaxis={"title": {"text": "message (fp32 gradient bytes)"}, "type": "log"},
                            yaxis={"title": {"text": "time (ms)"}, "type": "log"}, height=360))
    return figs


def pareto_front(rows: list[dict[str, Any]], chosen: dict[str, Any] | None = None,
                 references: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Predicted peak memory against predicted step time, coloured by predicted gradient error; the
    validated plans' measured points are drawn as crosses joined to their prediction, and the chosen
    plan (`chosen`: its summary, with predicted_peak_bytes and predicted_step_seconds) as a star."""
    peaks = [r.get("predicted_peak_bytes") for r in rows]
    unit, size = byte_unit(max((p for p in peaks if p is not None), default=None))
    labels = [str(r.get("plan") or f"row {i}") for i, r in enumerate(rows)]
    data = [{"type": "scatter", "mode": "markers", "name": "predicted",
             "x": _scaled(peaks, size), "y": [None if r.get("predicted_step_seconds") is None
                                              else r["predicted_step_seconds"] * 1e3 for r in rows],
             "text": labels,
             "marker": {"size": 11, "color": [r.get("predicted_grad_error") for r in rows],
                        "colorscale": "Plasma", "showscale": True,
                        "colorbar": {"title": {"text": "grad error"}}},
             "hovertemplate": "%{text}<br>peak %{x:.3f} " + unit + "<br>step %{y:.2f} ms"
                              "<br>grad error %{marker.color:.4f}<extra></extra>"}]
    validated = [r for r in rows if r.get("validated")]
    if validated:
        def measured_or_predicted(row: dict[str, Any], what: str) -> tuple[Any, str]:
            value = row.get(f"measured_{what}")
            return (value, "measured") if value is not None else (row.get(f"predicted_{what}"), "predicted")

        mx, mxs = zip(*(measured_or_predicted(r, "peak_bytes") for r in validated))
        my, mys = zip(*(measured_or_predicted(r, "step_seconds") for r in validated))
        data.append({"type": "scatter", "mode": "markers", "name": "measured",
                     "x": _scaled(list(mx), size), "y": [None if v is None else v * 1e3 for v in my],
                     "marker": {"symbol": "x", "size": 12, "color": "black"},
                     "text": [f"{r.get('plan') or ''}<br>peak {a}, step {b}" for r, a, b in zip(validated, mxs, mys)],
                     "hovertemplate": "%{text}<br>peak %{x:.3f} " + unit + "<br>step %{y:.2f} ms<extra></extra>"})
        seg_x, seg_y = [], []
        for r, x, y in zip(validated, mx, my):
            seg_x += [r.get("predicted_peak_bytes"), x, None]
            seg_y += [r.get("predicted_step_seconds"), y, None]
        data.append({"type": "scatter", "mode": "lines", "name": "prediction -> measurement",
                     "x": _scaled(seg_x, size), "y": [None if v is None else v * 1e3 for v in seg_y],
                     "line": {"color": "gray", "dash": "dot"}, "hoverinfo": "skip"})
    if chosen and chosen.get("predicted_peak_bytes") is not None and chosen.get("predicted_step_seconds") is not None:
        data.append({"type": "scatter", "mode": "markers", "name": "chosen plan",
                     "x": [chosen["predicted_peak_bytes"] / size], "y": [chosen["predicted_step_seconds"] * 1e3],
                     "marker": {"symbol": "star-open", "size": 20, "color": "#2ca02c", "line": {"width": 2}}})
    if chosen and chosen.get("measured_peak_bytes") is not None and chosen.get("measured_step_seconds") is not None:
        data.append({"type": "scatter", "mode": "markers", "name": "chosen plan, measured",
                     "x": [chosen["measured_peak_bytes"] / size], "y": [chosen["measured_step_seconds"] * 1e3],
                     "marker": {"symbol": "star", "size": 16, "color": "#2ca02c"}})
    if references:  # what the plan is judged against: the profile's plain bf16 and recipe steps
        data.append({"type": "scatter", "mode": "markers+text", "name": "profile's steps",
                     "x": [r["peak_bytes"] / size for r in references],
                     "y": [r["step_seconds"] * 1e3 for r in references],
                     "text": [r["name"] for r in references], "textposition": "top center",
                     "marker": {"symbol": "diamond", "size": 11, "color": "#7f7f7f"}})
    shapes = []
    budget = (chosen or {}).get("budget_bytes")
    if budget:  # the budget the search was run for: the plans left of it fit
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": budget / size, "x1": budget / size,
                       "y0": 0, "y1": 1, "line": {"color": "#d62728", "dash": "dash", "width": 1.5}})
        data.append({"type": "scatter", "mode": "lines", "name": f"budget ({budget / size:.3g} {unit})",
                     "x": [None], "y": [None], "line": {"color": "#d62728", "dash": "dash"}})
    return _figure(data, "The memory/error Pareto front's plans: peak memory vs step time (colour: gradient error)",
                   xaxis={"title": {"text": f"predicted peak memory ({unit})"}},
                   yaxis={"title": {"text": "predicted step time (ms)"}}, shapes=shapes)


def study_trials(study: dict[str, Any]) -> dict[str, Any] | None:
    """An Optuna study's finished trials: the first two objectives against each other, or the one
    objective against trial number."""
    trials = study.get("trials") or []
    if not trials:
        return None
    names = study.get("objectives") or [f"objective {i}" for i in range(len(study.get("directions") or [1]))]
    if len(trials[0]["values"]) >= 2:
        def feasible(t: dict[str, Any]) -> bool:
            constraint = (t.get("user_attrs") or {}).get("constraint")
            values = constraint if isinstance(constraint, list) else [constraint] if constraint is not None else []
            return all(isinstance(v, (int, float)) and v <= 0 for v in values)

        ok = [t for t in trials if feasible(t)]
        over = [t for t in trials if not feasible(t)]
        marker: dict[str, Any] = {"color": "#1f77b4", "size": 9}
        if len(trials[0]["values"]) >= 3:
            marker = {"size": 9, "color": [t["values"][2] if len(t["values"]) > 2 else None for t in ok],
                      "colorscale": "Plasma", "showscale": True, "colorbar": {"title": {"text": str(names[2])}}}
        data = [{"type": "scatter", "mode": "markers", "name": "feasible trials",
                 "x": [t["values"][0] for t in ok], "y": [t["values"][1] for t in ok],
                 "text": [f"trial {t['number']}" for t in ok], "marker": marker}]
        if over:
            data.append({"type": "scatter", "mode": "markers", "name": "over the budget (constraint > 0)",
                         "x": [t["values"][0] for t in over], "y": [t["values"][1] for t in over],
                         "text": [f"trial {t['number']}" for t in over],
                         "marker": {"symbol": "x-thin-open", "size": 9, "color": "#999999"}})
        return _figure(data, f"Optuna study {study['name']}: {len(trials)} finished trials",
                       xaxis={"title": {"text": str(names[0])}}, yaxis={"title": {"text": str(names[1])}})
    data = [{"type": "scatter", "mode": "markers", "name": "trials", "x": [t["number"] for t in trials],
             "y": [t["values"][0] if t["values"] else None for t in trials]}]
    return _figure(data, f"Optuna study {study['name']}: {len(trials)} finished trials",
                   xaxis={"title": {"text": "trial"}}, yaxis={"title": {"text": str(names[0])}})


PLAN_BITS_LABELS = (2, 4, 8, 16)  # bit widths labelled on the plan's colour bar
PLAN_EXACT_Z = 5.0  # where recomputed (0) and checkpointed (-1) cells sit on the bits colour scale, labelled "R"
PLAN_Z_RANGE = (0.5, 5.5)  # the colour bar: 2, 4, 8, 16 bits and R each in the middle of a band of width 1


def bits_z(bits: float | None) -> float | None:
    """Where a cell of the plan's map sits on its colour scale: log2 of its bit width (2 bits: 1, 4: 2, 8: 3, 16: 4),
    PLAN_EXACT_Z for a recomputed kind or checkpointed layer (0, -1), None for none."""
    if bits is None:
        return None
    return PLAN_EXACT_Z if bits <= 0 else math.log2(bits)


def plan_bits(bits: dict[str, Any]) -> dict[str, Any]:
    """The plan's bit width per layer and kind (R: recomputed, ckpt: whole layer checkpointed).

    Colour by error, which falls about geometrically with the bit width: on z = log2(bits), red for 2 bits through
    green for 16 (kept as is); recomputed kinds and checkpointed layers add no error, so they sit at PLAN_EXACT_Z in a
    blue band of their own. The colour bar's labels 2, 4, 8, 16 and R are then evenly spaced, a fifth of the bar
    apart, so none covers another."""
    ylabels = [f"{layer} (stage {stage})" if max(bits["stages"] or [0]) > 0 else layer
               for layer, stage in zip(bits["layers"], bits["stages"])]
    z = [[bits_z(v) for v in row] for row in bits["bits"]]
    lo, hi = PLAN_Z_RANGE
    at = lambda v: (v - lo) / (hi - lo)  # noqa: E731  (z -> position on the colour scale)
    band = at(PLAN_EXACT_Z - 0.5)
    scale = [[0.0, "#d73027"], [at(1.0), "#d73027"], [at(math.log2(5)), "#fee08b"], [at(4.0), "#1a9850"],
             [band, "#1a9850"], [band, "#4575b4"], [1.0, "#4575b4"]]
    labels = [math.log2(b) for b in PLAN_BITS_LABELS]
    return heat_map(z, bits["kinds"], ylabels, "Chosen plan: bits per layer and tensor kind",
                    "bits (blue R: recomputed, no error)", text=bits["text"], colorscale=scale, zmin=lo, zmax=hi,
                    hovertemplate="layer %{y}, %{x}: %{text}<extra></extra>",
                    colorbar_tickvals=[*labels, PLAN_EXACT_Z], colorbar_ticktext=[*map(str, PLAN_BITS_LABELS), "R"])


PART_COLORS = PALETTE + ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
                         "#dbdb8d", "#9edae5")  # one per part a plan may record (agoq.search.memory_parts.PARTS)
# the words of agoq.search.memory_parts.PHASE_NAMES (the dashboard imports nothing that loads agoq's kernels)
PHASE_LABELS = {"forward_backward": "end of forward", "backward_start": "start of backward (first prefetch)",
                "offload_backward": "backward of an offloaded layer", "optimizer_step": "optimizer step"}


def phase_label(phase: dict[str, Any] | None) -> str:
    """What a stage's predicted peak is: 'end of forward', 'optimizer step', 'backward of checkpointed layer N'."""
    if not phase:
        return "peak"
    if phase.get("phase") == "checkpoint_backward":
        return f"backward of checkpointed layer {phase.get('layer')}"
    if phase.get("phase") == "offload_backward" and phase.get("layer") is not None:
        return f"backward of offloaded layer {phase.get('layer')}"
    return PHASE_LABELS.get(str(phase.get("phase")), str(phase.get("phase")))


def memory_breakdown(mem: dict[str, Any]) -> dict[str, Any]:
    """Stacked bars per stage: the parts of the predicted peak the plan records, at the phase of the step that sets
    it (named under the bar), beside each measured peak; a plan without recorded parts shows its predicted peak
    whole. Parts that are 0 on every stage are left out; a negative part (head and workspace, whose calibration
    credits the gradients not made yet at the peak) is drawn below 0, and then the peak is marked on its bar. A plan
    that offloads layers has a bar for the second place, pinned host memory, beside its stage's GPU bars."""
    parts = {name: values for name, values in mem["predicted_parts"].items() if any(v for v in values)}
    measured = mem["measured_peak"]
    largest = max([v or 0 for p in parts.values() for v in p] + [v or 0 for m in measured.values() for v in m]
                  + [v or 0 for v in mem["predicted_peak"]] + [mem.get("host_bytes") or 0, 0])
    unit, size = byte_unit(largest)
    phases = mem.get("phases") or [None] * len(mem["stages"])
    labels = [f"stage {s}: predicted ({phase_label(p)})" for s, p in zip(mem["stages"], phases)]
    data = []
    if not mem.get("parts_recorded"):
        parts = {"peak (this plan records no parts)": mem["predicted_peak"]}
    for i, (name, values) in enumerate(parts.items()):
        data.append({"type": "bar", "name": f"predicted {name.replace('_', ' ')}",
                     "marker": {"color": PART_COLORS[i % len(PART_COLORS)]}, "x": labels[:len(values)],
                     "y": _scaled(values, size)})
    if mem.get("parts_recorded") and any(v < 0 for p in parts.values() for v in p if v is not None):
        data.append({"type": "scatter", "mode": "markers", "name": "predicted peak (the parts' sum)",
                     "marker": {"symbol": "line-ew-open", "size": 48, "color": "#000000", "line": {"width": 3}},
                     "x": labels[:len(mem["predicted_peak"])], "y": _scaled(mem["predicted_peak"], size)})
    host = mem.get("host_bytes")
    host_label = []
    if host:  # a second place: what the offloaded layers keep in pinned host memory (one stage: offload's only layout)
        layers = mem.get("offloaded_layers") or []
        host_label = [f"stage 0: host memory ({len(layers)} offloaded layer{'s' if len(layers) != 1 else ''})"]
        data.append({"type": "bar", "name": "host: offloaded layers' saved tensors, per micro-batch",
                     "marker": {"color": "#999999"}, "x": host_label, "y": _scaled([host], size)})
    for j, (label, values) in enumerate(measured.items()):
        data.append({"type": "bar", "name": f"measured ({label})",
                     "marker": {"color": "#444444", "pattern": {"shape": "/x+-."[j % 5]}},
                     "x": [f"stage {s}: {label}" for s in mem["stages"][:len(values)]], "y": _scaled(values, size)})
    order = [x for s, predicted in zip(mem["stages"], labels) for x in [predicted, *(f"stage {s}: {m}" for m in measured)]]
    order = order[:1] + host_label + order[1:]
    return _figure(data, "Memory per stage, one rank: the predicted peak's parts at the phase that sets it, beside "
                         "measured peaks", barmode="relative", yaxis={"title": {"text": unit}},
                   xaxis={"type": "category", "categoryorder": "array", "categoryarray": order})


def run_color(run_id: str) -> str:
    """One colour per run, the same on every page and whatever else is picked (a stable hash of its id)."""
    import zlib

    return PALETTE[zlib.crc32(run_id.encode()) % len(PALETTE)]


def smooth(values: list, weight: float = 0.9) -> list:
    """Exponential moving average (y_t = w y_(t-1) + (1 - w) x_t), skipping missing values."""
    out, acc = [], None
    for v in values:
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            out.append(None)
            continue
        acc = v if acc is None else weight * acc + (1 - weight) * v
        out.append(acc)
    return out


def _interp(xs: list, ys: list, at: list) -> list:
    """Linear interpolation of (xs, ys) at `at`, None outside [xs[0], xs[-1]] or where data is missing."""
    pts = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    out = []
    j = 0
    for a in at:
        if a is None or not pts or a < pts[0][0] or a > pts[-1][0]:
            out.append(None)
            continue
        while j + 1 < len(pts) and pts[j + 1][0] < a:
            j += 1
        j = min(j, len(pts) - 1)
        if pts[j][0] == a or j + 1 == len(pts):
            out.append(pts[j][1])
        else:
            (x0, y0), (x1, y1) = pts[j], pts[j + 1]
            out.append(y0 + (y1 - y0) * (a - x0) / (x1 - x0) if x1 > x0 else y0)
    return out


def run_curves(runs: list[dict[str, Any]], x: str = "step") -> list[dict[str, Any]]:
    """Loss with validation loss (dashed), tokens/s, peak memory per rank, gradient norm, learning rate, step
    time, and (against step, for two runs or more) each run's smoothed loss minus the first run's, one colour
    per run (run_color), against `x`: "step" or "time" (seconds since the run's first step)."""
    key = "elapsed_s" if x == "time" else "step"
    other = "step" if x == "time" else "elapsed_s"
    xtitle = "seconds since the first step" if x == "time" else "step"
    hover = ("%{x:.1f} s<br>step %{customdata}" if x == "time" else "step %{x}<br>%{customdata:.1f} s")
    loss, speed, memory = [], [], []
    largest = max((v or 0 for r in runs for p in r["curves"]["peak_bytes"] for v in p["value"]), default=0)
    unit, size = byte_unit(largest)

    def line(name: str, series: dict[str, list], y: list, what: str, **style: Any) -> dict[str, Any]:
        return {"type": "scatter", "mode": "lines", "name": name, "x": series.get(key), "y": y,
                "customdata": series.get(other), "hovertemplate": hover + f"<br>{what}<extra>{name}</extra>",
                **style}

    norm, rate, step_time, diff = [], [], [], []
    base = runs[0]
    base_loss = base["curves"]["series"]["loss"]
    base_smooth = smooth(base_loss["value"])
    for r in runs:
        color = run_color(r["id"])
        s = r["curves"]["series"]
        for name, target, fmt in (("grad_norm", norm, "%{y:.4g}"), ("lr", rate, "%{y:.3g}")):
            if s.get(name, {}).get("step"):
                target.append(line(r["id"], s[name], s[name]["value"], f"{name} {fmt}", line={"color": color}))
        if s.get("step_seconds", {}).get("step"):
            step_time.append(line(r["id"], s["step_seconds"], [None if v is None else v * 1e3
                                                               for v in s["step_seconds"]["value"]],
                                  "%{y:.2f} ms", line={"color": color}))
        if r is not base and x == "step" and s["loss"]["step"]:
            mine = smooth(s["loss"]["value"])
            ref = _interp(base_loss["step"], base_smooth, s["loss"]["step"])
            delta = [None if a is None or b is None else a - b for a, b in zip(mine, ref)]
            diff.append(line(r["id"], s["loss"], delta, "loss - baseline %{y:+.4f}", line={"color": color}))
        loss.append(line(f"{r['id']} loss", s["loss"], s["loss"]["value"], "loss %{y:.4f}", line={"color": color}))
        if s["val_loss"]["step"]:
            loss.append(line(f"{r['id']} val loss", s["val_loss"], s["val_loss"]["value"], "val loss %{y:.4f}",
                             mode="lines+markers", line={"color": color, "dash": "dash"}))
        speed.append(line(r["id"], s["tokens_per_s"], s["tokens_per_s"]["value"], "%{y:.0f} tokens/s",
                          line={"color": color}))
        for p in r["curves"]["peak_bytes"]:
            memory.append(line(f"{r['id']} rank {p['rank']}", p, _scaled(p["value"], size), "%{y:.3f} " + unit,
                               line={"color": color, "dash": ("solid", "dot", "dash", "dashdot")[p["rank"] % 4]}))
    return [
        _figure(loss, "Loss (solid) and validation loss (dashed)", xaxis={"title": {"text": xtitle}},
                yaxis={"title": {"text": "loss"}}),
        _figure(speed, "Throughput", xaxis={"title": {"text": xtitle}}, yaxis={"title": {"text": "tokens/s"}}),
        _figure(memory, "Peak memory per rank (GPU: torch's max allocated; CPU: the whole process's resident size)",
                xaxis={"title": {"text": xtitle}}, yaxis={"title": {"text": unit}}),
        _figure(norm, "Gradient norm (before clipping)", xaxis={"title": {"text": xtitle}},
                yaxis={"title": {"text": "norm"}}),
        _figure(rate, "Learning rate", xaxis={"title": {"text": xtitle}}, yaxis={"title": {"text": "lr"}}),
        _figure(step_time, "Step time", xaxis={"title": {"text": xtitle}}, yaxis={"title": {"text": "ms"}}),
    ] + ([_figure(diff, f"Training loss minus {base['id']}'s (both smoothed, EMA 0.9)",
                  xaxis={"title": {"text": xtitle}}, yaxis={"title": {"text": "loss difference"}})] if diff else [])
