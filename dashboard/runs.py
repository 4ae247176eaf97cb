"""A Run folder (run.json, metrics.jsonl) turned into key figures and thinned curves: loss and
validation loss against step, tokens/s and peak memory per rank against step and elapsed time.

metrics.jsonl grows while a run trains, so it is read incrementally: each request parses only the
complete lines appended since the last one (a rewritten or truncated file is read again from the
start)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agoq.files import json_safe
from agoq.formats.views import metric_record, read_run
from dashboard.discovery import Folder
from dashboard.downsample import minmax_indices
from dashboard.formats import format_bytes, number

TRAIN_FIELDS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "step_seconds", "time")
VAL_FIELDS = ("step", "val_loss", "time")


@dataclass
class Metrics:
    """Columns parsed so far from one metrics.jsonl; `offset` is the byte just after the last complete line."""

    inode: int = -1
    offset: int = 0
    train: dict[str, list] = field(default_factory=lambda: {k: [] for k in TRAIN_FIELDS})
    peak: list[list] = field(default_factory=list)
    val: dict[str, list] = field(default_factory=lambda: {k: [] for k in VAL_FIELDS})
    bad_lines: int = 0


class MetricsStore:
    """Parsed metrics per file, kept up to date by reading only what was appended."""

    def __init__(self) -> None:
        self._files: dict[str, Metrics] = {}
        self._lock = threading.Lock()

    def read(self, path: Path) -> Metrics:
        """The metrics of `path` up to its last complete line (an absent file reads as empty)."""
        with self._lock:
            key = str(path)
            try:
                st = os.stat(path)
            except OSError:
                return Metrics()
            current = self._files.get(key)
            if current is None or current.inode != st.st_ino or st.st_size < current.offset:
                current = Metrics(inode=st.st_ino)
                self._files[key] = current
            if st.st_size > current.offset:
                with open(path, "rb") as f:
                    f.seek(current.offset)
                    chunk = f.read(st.st_size - current.offset)
                end = chunk.rfind(b"\n") + 1
                for line in chunk[:end].splitlines():
                    _parse_line(current, line)
                current.offset += end
            return current


def _parse_line(m: Metrics, line: bytes) -> None:
    if not line.strip():
        return
    rec = metric_record(line)  # agoq.formats.run's parser of metrics.jsonl
    if rec is None:
        m.bad_lines += 1
        return
    step = int(rec["step"])
    if "val_loss" in rec and "loss" not in rec:
        m.val["step"].append(step)
        m.val["val_loss"].append(number(rec.get("val_loss")))
        m.val["time"].append(number(rec.get("time")))
        return
    m.train["step"].append(step)
    for name in TRAIN_FIELDS[1:]:
        m.train[name].append(number(rec.get(name)))
    peak = rec.get("peak_bytes")
    if isinstance(peak, (int, float)):
        peak = [peak]
    m.peak.append([number(v) for v in peak] if isinstance(peak, list) else [])
    if "val_loss" in rec:
        m.val["step"].append(step)
        m.val["val_loss"].append(number(rec.get("val_loss")))
        m.val["time"].append(number(rec.get("time")))


def _array(values: list) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def _thin(x: np.ndarray, y: np.ndarray, max_points: int, t: np.ndarray | None = None) -> dict[str, list]:
    idx = minmax_indices(y, max_points)
    out = {"step": x[idx].astype(np.int64).tolist(), "value": y[idx].tolist()}
    if t is not None:
        out["elapsed_s"] = t[idx].tolist()
    return json_safe(out)


STALE_SECONDS = 600  # a "running" run whose files have not changed for this long is shown as stale


def last_sign_of_life(meta: dict[str, Any], folder: Folder) -> float | None:
    """The latest of: the run's heartbeat (run.json "heartbeat", ISO time, written by agoq train at least
    every minute), its "updated" time, and the modification times of run.json and metrics.jsonl (epoch s)."""
    import datetime

    times = []
    for key in ("heartbeat", "updated"):
        text = meta.get(key)
        if isinstance(text, str):
            try:
                times.append(datetime.datetime.fromisoformat(text).timestamp())
            except ValueError:
                pass
    for name in ("run.json", "metrics.jsonl"):
        try:
            times.append(folder.file(name).stat().st_mtime)
        except OSError:
            pass
    return max(times) if times else None


def run_status(meta: dict[str, Any], folder: Folder, now: float | None = None) -> str:
    """run.json's status, except "stale" for a run that says "running" but has shown no sign of life for
    STALE_SECONDS (killed without a chance to say so, e.g. by SIGKILL or a lost node)."""
    import time

    status = meta.get("status")
    if status != "running":
        return status
    last = last_sign_of_life(meta, folder)
    now = time.time() if now is None else now
    return "stale" if last is not None and now - last > STALE_SECONDS else status


DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def run_label(plan: Any, settings: dict[str, Any]) -> str:
    """What a run trained with: its plan ('plan (milp), budget 2.1 MiB'); without one, its activation policy,
    gradient storage and optimizer where not plain ('policy agoq-paper (no plan), fp32'), else 'baseline (no
    plan), fp32', with the dtype it computed in (settings.dtype; bf16, agoq train's default on a GPU, when absent)."""
    if isinstance(plan, dict):
        source = plan.get("source") or {}
        budget = number(plan.get("budget_bytes"))
        label = "plan" + (f" ({source.get('method')})" if source.get("method") else "")
        return label + (f", budget {format_bytes(budget)}" if budget else "")
    dtype = settings.get("dtype")
    dtype = DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else "bf16"
    parts = [f"policy {settings['policy']}"] if settings.get("policy") else []
    if settings.get("gradients") not in (None, "bf16"):  # bf16: plain gradients in the parameters' dtype
        parts.append(f"{settings['gradients']} gradients")
    if settings.get("optimizer") not in (None, "adamw"):
        parts.append(str(settings["optimizer"]))
    return f"{', '.join(parts) or 'baseline'} (no plan), {dtype}"


def read_meta(folder: Folder) -> dict[str, Any]:
    """The folder's run.json as written, checked by agoq.formats (views.read_run); FormatError naming the file and
    the field otherwise."""
    return read_run(folder.file("run.json"), where="run.json")


def summary(folder: Folder, store: MetricsStore) -> dict[str, Any]:
    """Key figures of a run: model, what it trained with (run_label), status, step reached, last loss and
    validation loss, median tokens/s, highest peak memory of any rank, number of metric lines, and for a run with a
    plan what it measured against the plan's predictions (run.json's `plan_check`, agoq.train.plan_check)."""
    meta = read_meta(folder)
    m = store.read(folder.file("metrics.jsonl"))
    model = meta.get("model") or {}
    plan = meta.get("plan")
    settings = meta.get("settings") or {}
    loss = [v for v in m.train["loss"] if v is not None]
    val = [v for v in m.val["val_loss"] if v is not None]
    tps = [v for v in m.train["tokens_per_s"] if v is not None]
    peaks = [v for row in m.peak for v in row if v is not None]
    return json_safe({
        "model": model.get("name") or model.get("spec"),
        "fingerprint": model.get("fingerprint"),
        "plan": run_label(plan, settings),
        "status": run_status(meta, folder),
        "message": meta.get("message") or (f"no sign of life for over {STALE_SECONDS // 60} minutes: the process "
                                           "probably died; --resume continues from its last checkpoint"
                                           if run_status(meta, folder) == "stale" else None),
        "step": meta.get("step"),
        "steps": settings.get("steps"),
        "parallel": settings.get("parallel"),
        "world_size": (meta.get("world") or {}).get("size"),
        "device": (meta.get("hardware") or {}).get("device"),  # "cpu" or "cuda": what it trained on
        "started": meta.get("started"),
        "updated": meta.get("updated"),
        "last_loss": loss[-1] if loss else None,
        "last_val_loss": val[-1] if val else None,
        "median_tokens_per_s": float(np.median(tps)) if tps else None,
        "max_peak_bytes": max(peaks) if peaks else None,
        "plan_check": meta.get("plan_check") if isinstance(meta.get("plan_check"), dict) else None,
        "metric_lines": len(m.train["step"]) + len(m.val["step"]),
        "bad_lines": m.bad_lines,
    })


def curves(folder: Folder, store: MetricsStore, max_points: int = 2000) -> dict[str, Any]:
    """The run's curves, each thinned to at most `max_points` points (min and max per bucket):
    loss, val_loss, tokens_per_s and grad_norm against step (with elapsed seconds), and peak_bytes per
    rank. Totals before thinning are given so a reader can tell how much was thinned."""
    m = store.read(folder.file("metrics.jsonl"))
    step = _array(m.train["step"])
    t = _array(m.train["time"])
    t0 = np.nanmin(t) if len(t) and np.isfinite(t).any() else np.nan
    elapsed = t - t0
    series = {}
    for name in ("loss", "tokens_per_s", "grad_norm", "step_seconds", "lr"):
        series[name] = _thin(step, _array(m.train[name]), max_points, elapsed)
    vstep = _array(m.val["step"])
    vt = _array(m.val["time"]) - t0
    series["val_loss"] = _thin(vstep, _array(m.val["val_loss"]), max_points, vt)
    ranks = max((len(row) for row in m.peak), default=0)
    peak_series = []
    for r in range(ranks):
        y = np.array([row[r] if r < len(row) and row[r] is not None else np.nan for row in m.peak])
        peak_series.append({"rank": r, **_thin(step, y, max_points, elapsed)})
    return json_safe({"max_points": max_points, "train_points": len(step), "val_points": len(vstep),
                  "bad_lines": m.bad_lines, "series": series, "peak_bytes": peak_series})
