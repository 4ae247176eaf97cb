"""A search folder (pareto.csv, plan files, an Optuna study) turned into what the search page shows:
the Pareto front with its validated points, the chosen plan, and the study's trials."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from agoq.files import json_safe
from dashboard.discovery import Folder
from dashboard.formats import BrokenFile, number

PARETO_REQUIRED = ("predicted_peak_bytes", "predicted_step_seconds", "predicted_grad_error")
STUDY_FILES = ("study.db", "study.journal")


def read_pareto(folder: Folder) -> dict[str, Any]:
    """pareto.csv as rows (numbers parsed, text kept), with the columns in file order; an absent file
    gives no rows and a message. A row is 'validated' when it has a measured peak or step time."""
    path = folder.file("pareto.csv")
    if not path.exists():
        return {"columns": [], "rows": [], "message": "no pareto.csv in this search folder"}
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise BrokenFile(f"pareto.csv: cannot read it ({e})") from None
    reader = csv.DictReader(io.StringIO(text))
    columns = reader.fieldnames or []
    missing = [c for c in PARETO_REQUIRED if c not in columns]
    if missing:
        raise BrokenFile(f"pareto.csv: missing column(s) {', '.join(missing)}")
    rows = []
    for raw in reader:
        row: dict[str, Any] = {}
        for key, value in raw.items():
            if key is None:
                continue
            parsed = number(value)
            row[key] = parsed if parsed is not None or value in ("", None, "nan", "NaN") else value
        row["validated"] = any(row.get(k) is not None for k in ("measured_peak_bytes", "measured_step_seconds"))
        rows.append(row)
    return json_safe({"columns": columns, "rows": rows,
                  "message": None if rows else "pareto.csv has no rows"})


def chosen_plan_name(plans_here: list[str]) -> str | None:
    """The file name of a search's chosen plan: plan.json when present, else the only plan file lying
    directly in the folder (`plans_here`: their names; the Pareto front's plans sit in a subfolder)."""
    if "plan.json" in plans_here:
        return "plan.json"
    return plans_here[0] if len(plans_here) == 1 else None


def study_file(folder: Folder) -> Path | None:
    """The Optuna study of the search (study.db or study.journal), or None."""
    for name in STUDY_FILES:
        if folder.file(name).is_file():
            return folder.file(name)
    return None
