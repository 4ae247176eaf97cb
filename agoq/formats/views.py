"""Read-only views of agoq's files for readers that show them (the dashboard): each reads one file through its
format's owner (docs/formats.md) and checks it as that owner does, returning the data as written.

- `read_profile_header(path)`: profile.json, its schema and required sections checked
  (agoq.formats.profile_header.check_header, as load_profile checks them);
- `layout_steps(header)`: the multi-rank layout steps of a profile.json read above (agoq.formats.layout_steps);
- `read_profile_table(path, columns)`: profile.parquet (or .csv) or collectives.parquet as a DataFrame;
- `read_plan(path)`: plan.json (or any plan file), validated as agoq.formats.plan's Plan;
- `read_run(path)`: run.json, its schema and the types of its sections checked;
- `metric_record(line)`: one line of metrics.jsonl (agoq.formats.run's parser);
- `read_pareto(path)`: a search's Pareto CSV (agoq.formats.pareto).

Every problem is a FormatError (a ValueError) whose message names the file, as the caller's `where` gives it (by
default its path), and the field. JSON files are refused unread above agoq.files.MAX_JSON_BYTES. This module loads
no kernels and no torch: the plan's validator (pydantic, and the plan's words) is imported on the first plan read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agoq.formats.pareto import read_pareto
from agoq.formats.profile_header import PROFILE_SCHEMA_KIND, PROFILE_SCHEMA_MAJOR, check_header
from agoq.formats.run import RUN_SCHEMA_KIND, RUN_SCHEMA_MAJOR, metric_record
from agoq.formats.schema import FormatError, read_versioned


def _where(path: str | os.PathLike, where: str | None) -> str:
    return str(path) if where is None else where


def read_profile_header(path: str | os.PathLike, where: str | None = None) -> dict[str, Any]:
    """profile.json at `path` as written, checked as agoq.formats.profile.load_profile checks it: schema
    agoq.profile/N (N no newer than this agoq reads), the required sections (model, settings, memory) with their keys,
    timing.host_link when there is one, `files` (the table's and collectives' names) plain file names."""
    where = _where(path, where)
    header = read_versioned(path, PROFILE_SCHEMA_KIND, PROFILE_SCHEMA_MAJOR, where)
    check_header(header, where)
    return header


def layout_steps(header: dict[str, Any], where: str = "profile.json") -> list[dict[str, Any]]:
    """The layout steps of a profile header read by `read_profile_header` (profile.json `layout_steps`: a real step
    of each data-parallel layout on every rank), each row checked by agoq.formats.layout_steps; [] where it has none.
    FormatError naming the field of a malformed section."""
    from agoq.formats.layout_steps import layout_rows

    try:
        return layout_rows(header, where)
    except ValueError as e:
        raise FormatError(str(e)) from None


def read_profile_table(path: str | os.PathLike, columns: tuple[str, ...] = (), where: str | None = None):
    """A profile's table (profile.parquet, or profile.csv by its suffix, as agoq writes it where it has no pyarrow)
    or its collectives.parquet, as a pandas DataFrame with every one of `columns`; FormatError naming the file when it
    is missing, cannot be read or lacks a column."""
    import pandas as pd

    p = Path(path)
    where = _where(p, where)
    kind = "CSV" if p.suffix == ".csv" else "parquet"
    if not p.is_file():
        raise FormatError(f"{where}: missing (no such file)")
    try:
        frame = pd.read_csv(p) if kind == "CSV" else pd.read_parquet(p)
    except Exception as e:  # pyarrow and the CSV parser raise many kinds of errors on a damaged file
        said = str(e).replace(str(p), where)  # the file as the caller names it, also in pyarrow's words
        raise FormatError(f"{where}: cannot read it as {kind} ({type(e).__name__}: {said})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise FormatError(f"{where}: missing column(s) {', '.join(missing)}")
    return frame


def read_plan(path: str | os.PathLike, where: str | None = None) -> dict[str, Any]:
    """The plan file at `path` as written (a dict: fields the Plan fills with defaults stay absent, unknown ones are
    kept), after checking its schema (agoq.plan/N, N no newer than this agoq reads) and validating it whole as
    agoq.formats.plan's Plan (plan_from_dict: every section's fields, layers in order, stages contiguous, memory parts
    adding up to the peaks)."""
    from agoq.formats.plan import SCHEMA_KIND, SCHEMA_MAJOR, plan_from_dict

    where = _where(path, where)
    data = read_versioned(path, SCHEMA_KIND, SCHEMA_MAJOR, where)
    try:
        plan_from_dict(data, where)
    except ValueError as e:
        raise FormatError(str(e)) from None
    return data


RUN_SECTIONS = ("model", "plan", "settings", "world", "hardware", "software", "plan_check", "offload")  # objects


def read_run(path: str | os.PathLike, where: str | None = None) -> dict[str, Any]:
    """run.json at `path` as written (what `agoq train` keeps rewriting), checked: schema agoq.run/N (N no newer than
    this agoq reads), `status` a string (agoq train writes it from its first write on), and each of RUN_SECTIONS an
    object or null where present."""
    where = _where(path, where)
    run = read_versioned(path, RUN_SCHEMA_KIND, RUN_SCHEMA_MAJOR, where)
    if not isinstance(run.get("status"), str):
        got = "missing" if "status" not in run else f"{run['status']!r}"
        raise FormatError(f"{where}: status: {got}; expected running, finished, failed or stopped (agoq train "
                          "writes it)")
    for name in RUN_SECTIONS:
        value = run.get(name)
        if value is not None and not isinstance(value, dict):
            raise FormatError(f"{where}: {name}: must be an object or null, got {type(value).__name__}")
    step = run.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise FormatError(f"{where}: step: must be an integer, got {step!r}")
    return run


__all__ = ["FormatError", "layout_steps", "metric_record", "read_pareto", "read_plan", "read_profile_header", "read_profile_table",
           "read_run"]
