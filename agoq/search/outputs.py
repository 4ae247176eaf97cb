"""What a search writes beside its plan (`agoq search --out`): the plan, the front's plans and the Pareto CSV, each
named after the plan (`side_files`), so that searches into one folder share no file (docs/formats.md)."""

from __future__ import annotations

from pathlib import Path

from agoq.files import write_atomic
from agoq.formats.pareto import COLUMNS as PARETO_COLUMNS
from agoq.formats.pareto import pareto_csv

CSV_COLUMNS = PARETO_COLUMNS  # the Pareto CSV's format is agoq.formats.pareto's


def pareto_rows(candidates: list, plan_names: dict) -> list[dict]:
    """Rows of the Pareto front's CSV (OUT_STEM.pareto.csv): the MILP memory/error front and the Optuna front."""
    rows = []
    for c in candidates:
        if c.source == "milp":
            continue
        p = c.plan
        k = {"block": p.activations.block, "format": p.activations.format, "gradient_mode": p.gradients.mode,
             "micro_batch": p.training.micro_batch, "grad_accum": p.training.grad_accum}
        m = p.measured
        row = {"source": c.source, "trial": c.trial, "budget_bytes": int(c.budget_bytes),
               "predicted_peak_bytes": max(p.predicted.peak_bytes_per_stage),
               "predicted_step_seconds": p.predicted.step_seconds, "predicted_grad_error": p.predicted.grad_error,
               **k, "floors": "", "plan": plan_names.get(id(c), ""),
               "measured_peak_bytes": None if m is None else next((v for v in m.peak_bytes_per_stage if v is not None), None),
               "measured_step_seconds": None if m is None else m.step_seconds,
               "measured_loss_deviation": None if m is None else m.loss_deviation}
        floors = (p.source.model_extra or {}).get("floor_bits") or {}
        row["floors"] = " ".join(f"{kind}>={bits}" for kind, bits in floors.items())
        rows.append(row)
    return rows


def side_files(out: Path) -> dict:
    """The files a search writes beside its plan `out`, each named after it so that searches into one folder share
    none: "pareto" OUT_STEM.pareto.csv, "plans" the front's plans' folder OUT_STEM-pareto/, "study" the Optuna
    study OUT_STEM.study.db (SQLite) and "journal" OUT_STEM.study.journal (with several workers); for plan.json:
    plan.pareto.csv, plan-pareto/, plan.study.db, plan.study.journal."""
    out = Path(out)
    return {"pareto": out.with_name(f"{out.stem}.pareto.csv"), "plans": out.with_name(f"{out.stem}-pareto"),
            "study": out.with_name(f"{out.stem}.study.db"), "journal": out.with_name(f"{out.stem}.study.journal")}


def write_outputs(outcome, out: Path) -> dict:
    """Write the SearchOutcome's (agoq.search.search) plan at `out` (plan.json), the front's plans (OUT_STEM-pareto/NN.json) and OUT_STEM.pareto.csv beside it
    (side_files). The front's plans of an earlier search into the same `out` are removed first (only agoq's own
    SOURCE-NN.json files), so the folder never mixes two searches' fronts."""
    out = Path(out)
    folder = out.parent
    plans_dir = side_files(out)["plans"]
    if plans_dir.is_dir():
        for old in plans_dir.glob("*-[0-9][0-9].json"):
            old.unlink()
    outcome.plan.save(out)
    names = {}
    i = 0
    for c in outcome.candidates:
        if c.source == "milp":
            continue
        name = f"{plans_dir.name}/{c.source}-{i:02d}.json"
        c.plan.save(folder / name)
        names[id(c)] = name
        i += 1
    csv_path = side_files(out)["pareto"]
    write_atomic(csv_path, pareto_csv(pareto_rows(outcome.candidates, names)))
    return {"plan": out, "pareto": csv_path, "plans": plans_dir}
