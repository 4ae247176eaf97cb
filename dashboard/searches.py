"""A search folder (pareto.csv, plan files, an Optuna study) turned into what the search page shows:
the Pareto front with its validated points, the chosen plan, and the study's trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agoq.files import json_safe
from agoq.formats import views
from dashboard.discovery import Folder

STUDY_FILES = ("study.db", "study.journal")


def newest_named(folder: Folder, names: tuple[str, ...], suffixes: tuple[str, ...]) -> Path | None:
    """The most recently written of the folder's files called one of `names` (as earlier agoq wrote them: pareto.csv,
    study.db) or ending in one of `suffixes` (named after the plan: plan.pareto.csv), None when none is; a
    folder holding several searches shows its latest."""
    try:
        found = [p.name for p in folder.path.iterdir() if p.name in names or p.name.endswith(suffixes)]
    except OSError:
        return None
    paths = [folder.file(n) for n in sorted(found)]
    paths = [p for p in paths if p.is_file()]
    return max(paths, key=lambda p: p.stat().st_mtime_ns) if paths else None


def read_pareto(folder: Folder) -> dict[str, Any]:
    """The search's Pareto CSV (PLAN_STEM.pareto.csv, or pareto.csv as agoq wrote it before: `newest_named`), read by
    agoq.formats (views.read_pareto: numbers parsed, text kept, the columns in file order); an absent file gives no
    rows and a message. A row is 'validated' when it has a measured peak or step time."""
    path = newest_named(folder, ("pareto.csv",), (".pareto.csv",))
    if path is None:
        return {"columns": [], "rows": [], "message": "no pareto.csv (or PLAN.pareto.csv) in this search folder"}
    front = views.read_pareto(path, where=path.name)
    rows = front["rows"]
    for row in rows:
        row["validated"] = any(row.get(k) is not None for k in ("measured_peak_bytes", "measured_step_seconds"))
    return json_safe({"columns": front["columns"], "rows": rows,
                      "message": None if rows else f"{path.name} has no rows"})


def chosen_plan_name(plans_here: list[str]) -> str | None:
    """The file name of a search's chosen plan: plan.json when present, else the only plan file lying
    directly in the folder (`plans_here`: their names; the Pareto front's plans sit in a subfolder)."""
    if "plan.json" in plans_here:
        return "plan.json"
    return plans_here[0] if len(plans_here) == 1 else None


def study_file(folder: Folder) -> Path | None:
    """The Optuna study of the search (PLAN_STEM.study.db or .study.journal, or study.db / study.journal as agoq
    wrote them before: the latest, `newest_named`), or None."""
    return newest_named(folder, STUDY_FILES, tuple("." + n for n in STUDY_FILES))
