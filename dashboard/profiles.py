"""A Profile folder (profile.json, profile.parquet, collectives.parquet) turned into what the profile
page shows: key figures, layer x kind heat maps of sensitivity and bytes at one option, error vs
bit-width curves per kind, and collective time vs message size per path."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from agoq.files import json_safe
from agoq.formats.views import FormatError, read_profile_header, read_profile_table
from dashboard.discovery import Folder
from dashboard.formats import number

TABLE_COLUMNS = ("layer", "kind", "option", "bits", "bytes", "quant_error", "sensitivity")
COLLECTIVE_COLUMNS = ("op", "path", "world_size", "message_bytes", "seconds")


def stat_key(path: Path) -> tuple[int, int] | None:
    """(mtime in ns, size in bytes) of a file, or None when it is absent: a cache key that changes
    whenever the file is rewritten."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=32)
def _read_table(path: str, key: tuple[int, int], columns: tuple[str, ...]):
    return read_profile_table(path, columns, where=Path(path).name)


def read_table(path: Path, columns: tuple[str, ...]):
    """The parquet (or, by its suffix, CSV) file at `path` as a DataFrame (agoq.formats.views.read_profile_table,
    cached until the file changes); FormatError when it cannot be read or lacks one of `columns`."""
    key = stat_key(path)
    if key is None:
        raise FormatError(f"{path.name}: missing")
    return _read_table(str(path), key, columns)


def header(folder: Folder) -> dict[str, Any]:
    """The folder's profile.json as written, checked by agoq.formats (read_profile_header); FormatError naming the
    file and the field otherwise."""
    return read_profile_header(folder.file("profile.json"), where="profile.json")


def as_text(column):
    """A column's values as strings, a missing value as "nan": the same under pandas 2 and 3 (pandas 3's
    `astype(str)` keeps missing values missing, pandas 2's writes "nan" or "None")."""
    return column.map(lambda v: "nan" if v is None or (isinstance(v, float) and v != v) else str(v))


def option_order(option: str) -> tuple[int, int]:
    """Sort key for options: 16 first, then narrower widths, recompute last."""
    if option == "recompute":
        return (1, 0)
    try:
        return (0, -int(option))
    except ValueError:
        return (0, 1)


def table_file(folder: Folder, which: str = "table") -> Path:
    """The profile's table ("table": profile.parquet, or profile.csv where the profiler had no
    pyarrow) or collective timings ("collectives"), as profile.json's `files` names them."""
    default = {"table": "profile.parquet", "collectives": "collectives.parquet"}[which]
    return folder.file((header(folder).get("files") or {}).get(which) or default)


def _exists(folder: Folder, which: str) -> bool:
    try:
        return table_file(folder, which).exists()
    except FormatError:
        return False


def summary(folder: Folder) -> dict[str, Any]:
    """Key figures of a profile: model, hardware, date, settings, number of table rows and failures."""
    meta = header(folder)
    model = meta.get("model") or {}
    hardware = meta.get("hardware") or {}
    memory = meta.get("memory") or {}
    out = {
        "model": model.get("name") or model.get("spec"),
        "fingerprint": model.get("fingerprint"),
        "num_layers": model.get("num_layers"),
        "parameters": model.get("parameters"),
        "weight_bytes": model.get("weight_bytes"),
        "device": hardware.get("name") or hardware.get("device"),
        "hardware_device": hardware.get("device"),  # "cpu" or "cuda": what measured it
        "date": meta.get("date"),
        "settings": meta.get("settings") or {},
        "memory": memory,
        "failures": meta.get("failures") or [],
        "has_table": _exists(folder, "table"),
        "has_collectives": _exists(folder, "collectives"),
    }
    return json_safe(out)


def layer_kind_maps(folder: Folder, option: str | None = None) -> dict[str, Any]:
    """Heat maps over (layer, kind) at one option ("4", "8", "recompute", ...; default 4 bits when
    profiled, else the narrowest width): sensitivity (relative L2 error of all weight gradients) and
    bytes kept per micro-batch. Rows are layers, columns kinds in the order the profile lists them."""
    frame = read_table(table_file(folder), TABLE_COLUMNS)
    frame = frame.assign(option=as_text(frame["option"]))
    options = sorted(frame["option"].unique().tolist(), key=option_order)
    if not options:
        raise FormatError("profile.parquet: no rows")
    if option is None:
        widths = [o for o in options if o.isdigit() and o != "16"]
        option = "4" if "4" in options else (widths[-1] if widths else options[0])
    if option not in options:
        raise KeyError(f"option {option!r} is not in this profile; it has {', '.join(options)}")
    kinds = list(dict.fromkeys(as_text(frame["kind"])))
    layers = sorted(int(x) for x in frame["layer"].unique())
    rows = frame[frame["option"] == option]
    if "format" in rows.columns and rows["format"].nunique() > 1:
        rows = rows[rows["format"] == sorted(rows["format"].unique(), key=lambda f: f != "int")[0]]
    grid = {name: [[None] * len(kinds) for _ in layers] for name in ("sensitivity", "bytes", "quant_error")}
    li = {layer: i for i, layer in enumerate(layers)}
    ki = {kind: j for j, kind in enumerate(kinds)}
    for rec in rows[["layer", "kind", "sensitivity", "bytes", "quant_error"]].itertuples(index=False):
        i, j = li[int(rec.layer)], ki[str(rec.kind)]
        grid["sensitivity"][i][j] = number(rec.sensitivity)
        grid["bytes"][i][j] = number(rec.bytes)
        grid["quant_error"][i][j] = number(rec.quant_error)
    return json_safe({"option": option, "options": options, "layers": layers, "kinds": kinds, **grid})


def error_curves(folder: Folder) -> dict[str, Any]:
    """Per kind (and format), the mean over layers of the tensor's own error and of the weight-gradient
    sensitivity, against bit width (quantized options only; 16 and recompute are left out)."""
    frame = read_table(table_file(folder), TABLE_COLUMNS)
    quant = frame[(frame["bits"] > 0) & (frame["bits"] < 16)]
    group_cols = ["kind", "format"] if "format" in quant.columns else ["kind"]
    curves = []
    for key, part in quant.groupby(group_cols, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        means = part.groupby("bits")[["quant_error", "sensitivity"]].mean().sort_index()
        curves.append({"kind": str(key[0]), "format": str(key[1]) if len(key) > 1 else "int",
                       "bits": [int(b) for b in means.index],
                       "quant_error": [number(v) for v in means["quant_error"]],
                       "sensitivity": [number(v) for v in means["sensitivity"]]})
    return json_safe({"curves": curves})


def collectives(folder: Folder) -> dict[str, Any]:
    """Collective time against message size, one series per (op, path, world size); empty when the
    profile measured none."""
    path = table_file(folder, "collectives")
    if not path.exists():
        return {"series": [], "message": f"no {path.name}: this profile measured no collectives "
                                          "(profile with a process group or --world-size to get them)"}
    frame = read_table(path, COLLECTIVE_COLUMNS)
    series = []
    for (op, comm_path, world), part in frame.groupby(["op", "path", "world_size"], sort=True):
        part = part.sort_values("message_bytes")
        label = str(comm_path)
        backends = set(as_text(part["backend"].dropna())) if "backend" in part else set()
        if label.startswith("nccl-") and len(backends) == 1 and backends != {"nccl"}:
            # "nccl-*" names torch.distributed's own collectives; say which backend they really ran on
            label = f"{backends.pop()}-{label[len('nccl-'):]}"
        series.append({"op": str(op), "path": label, "world_size": int(world),
                       "message_bytes": [number(v) for v in part["message_bytes"]],
                       "seconds": [number(v) for v in part["seconds"]]})
    return json_safe({"series": series, "message": None if series else f"{path.name} has no rows"})


TIME_COLUMNS = ("layer", "kind", "option", "quantize_seconds", "dequantize_seconds", "recompute_seconds")


def kind_times(folder: Folder) -> dict[str, Any]:
    """Per kind, the mean over layers of what each option adds to a step: quantize and dequantize time per
    bit width (int format) and recompute time, in seconds; empty for profiles without these columns."""
    frame = read_table(table_file(folder), ("layer", "kind", "option"))
    if not all(c in frame.columns for c in TIME_COLUMNS):
        return {"rows": [], "options": [], "message": "this profile has no per-option kernel times"}
    if "format" in frame.columns:
        old = as_text(frame["format"]).isin(["int", "nan", "None", ""])  # int, or written before formats
        frame = frame[old | (as_text(frame["option"]) == "recompute")]
    options = sorted({str(o) for o in frame["option"]} - {"16"}, key=option_order)
    rows = []
    for kind, part in frame.groupby("kind", sort=False):
        row = {"kind": str(kind)}
        for option, opt_part in part.groupby(as_text(part["option"])):
            if option == "16":
                continue
            if option == "recompute":
                row["recompute"] = number(opt_part["recompute_seconds"].mean())
            else:
                row[option] = number((opt_part["quantize_seconds"] + opt_part["dequantize_seconds"]).mean())
        rows.append(row)
    return json_safe({"rows": rows, "options": options, "message": None})
