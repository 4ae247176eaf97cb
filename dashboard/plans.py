"""A Plan (plan.json) turned into what the search page shows: key figures, a layer x kind map of the
chosen bit widths, and a per-stage memory breakdown (the parts of the predicted peak the plan records: weights,
gradients, optimizer state, activations, ...) predicted beside measured."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from agoq.files import json_safe
from agoq.formats import views
from agoq.formats.views import FormatError
from agoq.parallel_dims import plan_dims
from dashboard.cluster import layout
from dashboard.formats import number
from dashboard.profiles import stat_key

RECOMPUTE = 0      # value of "recompute" in the bit-width map
CHECKPOINT = -1    # value of a layer recomputed whole (checkpoint: true)


@lru_cache(maxsize=256)
def _read_plan(path: str, key: tuple[int, int]) -> dict[str, Any]:
    return views.read_plan(path, where=Path(path).name)


def read_plan(path: Path) -> dict[str, Any]:
    """The plan at `path` as written, validated by agoq.formats (views.read_plan; FormatError naming the file and the
    field when it is not a readable plan); validated once until the file changes, each caller given its own copy."""
    key = stat_key(path)
    if key is None:
        raise FormatError(f"{path.name}: missing")
    return copy.deepcopy(_read_plan(str(path), key))


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
        "profiled_on": source.get("device"),  # the device the plan's profile was measured on (plan schema 1.6)
        "layout": layout(plan),  # its ranks as dimensions, with the data ranks (dashboard.cluster)
    })


def was_measured(plan: dict[str, Any]) -> bool:
    """Whether the plan records a real run of it (`measured`: a peak or a step time; on a CPU only the time)."""
    measured = plan.get("measured") or {}
    return any(number(v) is not None for v in measured.get("peak_bytes_per_stage") or []) \
        or number(measured.get("step_seconds")) is not None


def signature(plan: dict[str, Any]) -> str:
    """What makes two plans the same plan to train (as `agoq search --validate` tells them apart): the layers'
    choices, activations, training shape and gradient storage."""
    return json.dumps({k: plan.get(k) for k in ("layers", "activations", "training", "gradients")}, sort_keys=True)




def request_settings(plan: dict[str, Any]) -> dict[str, Any]:
    """The search request's fields (as POST /api/plan takes them) that give this plan's own layout and settings:
    {budget_bytes, objective, error_cap, layout, gradients}, from the plan's decision (the knobs it chose, the
    objective and where its error cap came from), else its parallel dims and gradient mode. A field the plan does not
    say is None (the service's default): the time cap always, as a "checkpoint" cap is recorded only as its value
    at the plan's budget."""
    decision = plan.get("decision") or {}
    knobs = decision.get("knobs") or {}
    try:
        dims = plan_dims(plan)  # its `parallel`, or an older plan's `launch`
    except ValueError:
        dims = None  # dims its loader refuses: the layout is left to the service's default
    layout = knobs.get("layout") or (dims.layout if dims is not None and dims.pipeline == 1 else None)
    gradients = knobs.get("gradients") or (plan.get("gradients") or {}).get("mode")
    error_cap = None
    if decision:
        source = decision.get("error_cap_source")
        error_cap = "recipe" if source == "recipe" else (number(decision.get("error_cap")) if source else "none")
    return json_safe({"budget_bytes": plan.get("budget_bytes"),
                      "objective": decision.get("objective") or (plan.get("source") or {}).get("objective"),
                      "error_cap": error_cap, "layout": layout, "gradients": gradients})


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


def memory_breakdown(plan: dict[str, Any], run_peaks: dict[str, list[float | None]] | None = None) -> dict[str, Any]:
    """Per pipeline stage, the parts of the predicted peak as the search recorded them in the plan
    (`predicted.memory_per_stage`, plan schema 1.2: bytes on one rank of the stage at the phase of the step that
    sets its peak, adding up to it; `phases` names that phase, with the checkpointed layer whose backward it is),
    nothing recomputed here; a plan written before 1.2 has no parts (`parts_recorded` false) and shows its peak
    alone; a plan that offloads layers (schema 1.4) also gives the pinned host bytes they hold (`host_bytes`, per
    micro-batch) and which layers (`offloaded_layers`). Beside it the measured peak of each stage from the plan's
    validation and from each run that trained
    with this plan (`run_peaks`: run id -> peak bytes per rank, None for a CPU run, which is listed in `cpu_runs`
    but not compared; rank s is taken as stage s when there are as many ranks as stages, else the largest rank's
    peak)."""
    predicted = plan.get("predicted") or {}
    peaks = [number(v) for v in predicted.get("peak_bytes_per_stage") or []]
    by_stage = _recorded_stages(predicted.get("memory_per_stage"))
    stage_of = [int(e.get("stage", 0)) for e in plan.get("layers") or []]
    stages = max(len(peaks), max(by_stage, default=-1) + 1, int((plan.get("pipeline") or {}).get("stages", 1) or 1),
                 (max(stage_of) + 1) if stage_of else 1)
    names: list[str] = []
    for m in by_stage.values():
        names += [name for name in m["parts"] if name not in names]
    parts = {name: [by_stage[s]["parts"].get(name, 0.0) if s in by_stage else None for s in range(stages)]
             for name in names}
    phases = [{"phase": by_stage[s]["phase"], "layer": by_stage[s]["layer"]} if s in by_stage else None
              for s in range(stages)]
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
    offloaded = [int(e.get("layer", i)) for i, e in enumerate(plan.get("layers") or []) if e.get("offload")]
    return json_safe({"stages": list(range(stages)), "predicted_parts": parts, "phases": phases,
                      "parts_recorded": bool(by_stage), "predicted_peak": peaks, "measured_peak": measured,
                      "cpu_runs": cpu_runs, "gradient_mode": (plan.get("gradients") or {}).get("mode", "bf16"),
                      "offloaded_layers": offloaded, "host_bytes": number(predicted.get("host_bytes"))})


def _recorded_stages(entries: Any) -> dict[int, dict[str, Any]]:
    """stage -> {phase, layer, parts} of a plan's `predicted.memory_per_stage` as written (FormatError naming the
    entry when one is not {stage, phase, parts: {name: bytes}})."""
    out: dict[int, dict[str, Any]] = {}
    for i, m in enumerate(entries or []):
        where = f"plan: predicted.memory_per_stage[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("parts"), dict):
            raise FormatError(f"{where}: expected {{stage, phase, parts: {{name: bytes}}}}")
        stage = number(m.get("stage"))
        values = {str(name): number(v) for name, v in m["parts"].items()}
        if stage is None or stage < 0 or stage != int(stage) or any(v is None for v in values.values()):
            raise FormatError(f"{where}: its stage and each part's bytes must be numbers")
        layer = number(m.get("layer"))
        out[int(stage)] = {"phase": str(m.get("phase")), "layer": None if layer is None else int(layer),
                           "parts": values}
    return out
