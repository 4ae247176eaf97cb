"""A Plan (plan.json) turned into what the search page shows: key figures, a layer x kind map of the
chosen bit widths, and a per-stage memory breakdown (weights, gradients, optimizer state, activations)
predicted beside measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agoq.files import json_safe
from dashboard.formats import BrokenFile, number, read_json

RECOMPUTE = 0      # value of "recompute" in the bit-width map
CHECKPOINT = -1    # value of a layer recomputed whole (checkpoint: true)


def read_plan(path: Path) -> dict[str, Any]:
    """The plan at `path`, schema-checked (BrokenFile when it is not a readable agoq.plan/1)."""
    plan = read_json(path, "plan")
    if not isinstance(plan.get("layers"), list):
        raise BrokenFile(f"{path.name}: field 'layers' is missing or not a list")
    return plan


def summary(plan: dict[str, Any]) -> dict[str, Any]:
    """Key figures of a plan: model, budget, gradient mode, predicted and measured peak (largest
    stage) and step time, predicted gradient error, how it was found."""
    predicted = plan.get("predicted") or {}
    measured = plan.get("measured") or {}
    peaks = [number(v) for v in predicted.get("peak_bytes_per_stage") or []]
    mpeaks = [number(v) for v in measured.get("peak_bytes_per_stage") or []]
    source = plan.get("source") or {}
    return json_safe({
        "model": (plan.get("model") or {}).get("name"),
        "fingerprint": (plan.get("model") or {}).get("fingerprint"),
        "budget_bytes": plan.get("budget_bytes"),
        "gradients": (plan.get("gradients") or {}).get("mode"),
        "stages": (plan.get("pipeline") or {}).get("stages", 1),
        "layers": len(plan.get("layers") or []),
        "predicted_peak_bytes": max((p for p in peaks if p is not None), default=None),
        "predicted_step_seconds": predicted.get("step_seconds"),
        "predicted_grad_error": predicted.get("grad_error"),
        "measured_peak_bytes": max((p for p in mpeaks if p is not None), default=None),
        "measured_step_seconds": measured.get("step_seconds"),
        "validated": bool(measured),
        "measured_device": measured.get("device"),
        "notes": [str(n) for n in (source.get("notes") or [])] + ([str(measured["note"])] if measured.get("note") else []),
        "method": source.get("method"),
        "objective": source.get("objective"),
        "date": source.get("date"),
    })


def bit_map(plan: dict[str, Any]) -> dict[str, Any]:
    """Layer x kind map of the plan: the bit width per (layer, kind), 0 for recompute, -1 for a layer
    checkpointed whole; `text` holds the label shown in each cell."""
    layers = sorted(plan["layers"], key=lambda entry: int(entry.get("layer", 0)))
    kinds: list[str] = []
    for entry in layers:
        for kind in (entry.get("kinds") or {}):
            if kind not in kinds:
                kinds.append(kind)
    z, text = [], []
    for entry in layers:
        row, labels = [], []
        for kind in kinds:
            value = (entry.get("kinds") or {}).get(kind)
            if entry.get("checkpoint"):
                row.append(CHECKPOINT)
                labels.append("ckpt")
            elif value == "recompute":
                row.append(RECOMPUTE)
                labels.append("R")
            elif value is None:
                row.append(None)
                labels.append("")
            else:
                row.append(int(value))
                labels.append(str(int(value)))
        z.append(row)
        text.append(labels)
    return {"layers": [int(e.get("layer", i)) for i, e in enumerate(layers)],
            "stages": [int(e.get("stage", 0)) for e in layers], "kinds": kinds, "bits": z, "text": text}


def memory_breakdown(plan: dict[str, Any], profile: dict[str, Any] | None,
                     run_peaks: dict[str, list[float | None]] | None = None) -> dict[str, Any]:
    """Per pipeline stage, the predicted parts of the peak: weights, gradients (bf16 or 8-bit by the
    plan's gradient mode), optimizer state (AdamW) and the stage's activations, split over stages by
    their share of decoder layers, plus 'other' (what the predicted peak holds beyond those parts);
    beside it the measured peak of each stage from the plan's validation and from each run that
    trained with this plan (`run_peaks`: run id -> peak bytes per rank, None for a CPU run, which is
    listed in `cpu_runs` but not compared; rank s is taken as stage s when there are as many ranks as
    stages, else the largest rank's peak)."""
    predicted = plan.get("predicted") or {}
    peaks = [number(v) for v in predicted.get("peak_bytes_per_stage") or []]
    acts = [number(v) for v in predicted.get("activation_bytes_per_stage") or []]
    stage_of = [int(e.get("stage", 0)) for e in plan.get("layers") or []]
    stages = max(len(peaks), len(acts), int((plan.get("pipeline") or {}).get("stages", 1) or 1),
                 (max(stage_of) + 1) if stage_of else 1)
    share = [stage_of.count(s) / len(stage_of) if stage_of else 1.0 / stages for s in range(stages)]
    memory = (profile or {}).get("memory") or {}
    mode = (plan.get("gradients") or {}).get("mode", "bf16")
    grad_key = "gradients_bytes_quangrad8" if mode in ("quangrad8", "sdp4bit") else "gradients_bytes_bf16"
    whole = {"weights": number(memory.get("weights_bytes")), "gradients": number(memory.get(grad_key)),
             "optimizer": number(memory.get("optimizer_bytes_adamw"))}
    parts: dict[str, list[float | None]] = {name: [] for name in ("weights", "gradients", "optimizer",
                                                                  "activations", "other")}
    for s in range(stages):
        for name, total in whole.items():
            parts[name].append(total * share[s] if total is not None else None)
        act = acts[s] if s < len(acts) else None
        parts["activations"].append(act)
        peak = peaks[s] if s < len(peaks) else None
        known = sum(v[s] for v in (parts["weights"], parts["gradients"], parts["optimizer"],
                                   parts["activations"]) if v[s] is not None)
        parts["other"].append(max(peak - known, 0.0) if peak is not None else None)
    measured = {}
    cpu_runs = sorted(run_id for run_id, ranks in (run_peaks or {}).items() if ranks is None)
    mplan = plan.get("measured") or {}
    if any(number(v) is not None for v in mplan.get("peak_bytes_per_stage") or []):
        measured["plan validation"] = [number(v) for v in mplan["peak_bytes_per_stage"]][:stages]
    for run_id, ranks in (run_peaks or {}).items():
        if ranks is None:
            continue
        if len(ranks) == stages:
            measured[f"run {run_id}"] = ranks
        elif ranks and stages == 1:
            measured[f"run {run_id}"] = [max((r for r in ranks if r is not None), default=None)]
    return json_safe({"stages": list(range(stages)), "predicted_parts": parts, "predicted_peak": peaks,
                  "measured_peak": measured, "cpu_runs": cpu_runs, "profile_found": profile is not None, "gradient_mode": mode})
