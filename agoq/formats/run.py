"""What a run leaves in RUN_DIR: run.json (rewritten atomically as the run goes) and metrics.jsonl (appended).

See docs/formats.md ("Run"). Only rank 0 writes. While a run trains, a background thread refreshes
run.json's `heartbeat` every `RunRecord.heartbeat_seconds` (30 s), also through long steps, evaluations and
checkpoint saves: a run whose status is "running" but whose heartbeat is old was killed without a word.
"""

from __future__ import annotations

import datetime
import json
import math
import threading
from pathlib import Path
from typing import Any

from agoq.files import json_safe, write_atomic, write_json

RUN_SCHEMA_KIND = "agoq.run"
RUN_SCHEMA_MAJOR = 1
RUN_SCHEMA = f"{RUN_SCHEMA_KIND}/{RUN_SCHEMA_MAJOR}"


def metric_record(line: str | bytes) -> dict | None:
    """One line of metrics.jsonl as its record: a JSON object with an integer `step` (a training step's loss,
    grad_norm, lr, tokens_per_s, step_seconds, peak_bytes per rank, time; or a validation's val_loss and time), None
    for a line that is not one (cut short by a kill, or garbage). The one parser of the file's lines."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step != int(step):
        return None
    return record


def now_iso() -> str:
    """The current UTC time, ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class RunRecord:
    """run.json and metrics.jsonl of one run folder."""

    heartbeat_seconds = 30.0  # how often the heartbeat thread rewrites run.json (readers allow twice this)

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.run_path = self.dir / "run.json"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.run: dict[str, Any] = {}
        self._lock = threading.Lock()  # run.json is written by the loop and by the heartbeat thread
        self._stop_beating = threading.Event()
        self._beater: threading.Thread | None = None

    def existing(self) -> dict | None:
        """The run.json already in the folder, or None."""
        return read_run(self.dir)

    def start(self, run: dict[str, Any], resumed_from: int | None,
              changed: dict[str, list] | None = None) -> None:
        """Write run.json with status "running"; on resume keep `started` and drop metrics after the checkpoint.

        `changed` ({setting: [old, new]}, resume only) is recorded in the new `resumed` entry; once any
        resume changed a setting, `original_settings` keeps the settings the run started with.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        old = self.existing()
        started = old.get("started") if (resumed_from is not None and old) else None
        self.run = {"schema": RUN_SCHEMA, **run, "status": "running", "started": started or now_iso(),
                    "updated": now_iso(), "step": resumed_from or 0, "message": None}
        if resumed_from is not None:
            old = old or {}
            self.run["resumed"] = old.get("resumed", []) + [{"step": resumed_from, "date": now_iso(),
                                                             "changed": dict(changed or {})}]
            original = old.get("original_settings") or (old.get("settings") if changed else None)
            if original is not None:
                self.run["original_settings"] = original
        self._write()
        self.truncate_metrics(resumed_from or 0)

    def _write(self) -> None:
        with self._lock:
            self.run["heartbeat"] = now_iso()
            write_json(self.run_path, json_safe(self.run))

    def truncate_metrics(self, step: int) -> None:
        """Keep only metric lines up to and including `step` (lines written after the last checkpoint go)."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            record = metric_record(line)
            if record is not None and record["step"] <= step:  # a line cut short by a kill is dropped
                kept.append(line)
        write_atomic(self.metrics_path, "".join(k + "\n" for k in kept))

    def update(self, step: int, status: str = "running", message: str | None = None) -> None:
        """Rewrite run.json with the current step, status and message."""
        with self._lock:
            self.run.update(step=step, status=status, message=message, updated=now_iso())
        self._write()

    def note(self, **fields: Any) -> None:
        """Set top-level fields of run.json (e.g. `plan_check`) and rewrite it."""
        with self._lock:
            self.run.update(fields, updated=now_iso())
        self._write()

    def beat(self) -> None:
        """Refresh `heartbeat` (and nothing else) in run.json."""
        self._write()

    def start_heartbeat(self) -> None:
        """Refresh `heartbeat` every `heartbeat_seconds` from a daemon thread until `stop_heartbeat`."""
        if self._beater is not None:
            return
        self._stop_beating.clear()

        def loop() -> None:
            while not self._stop_beating.wait(self.heartbeat_seconds):
                try:
                    self.beat()
                except OSError:  # a full disk or a vanished folder must not kill the run from here
                    pass

        self._beater = threading.Thread(target=loop, name="agoq-run-heartbeat", daemon=True)
        self._beater.start()

    def stop_heartbeat(self) -> None:
        if self._beater is not None:
            self._stop_beating.set()
            self._beater.join()
            self._beater = None

    def append(self, record: dict[str, Any]) -> None:
        """Append one line to metrics.jsonl and flush it (a killed process leaves at most a cut last line)."""
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")
            f.flush()


def measured_against_plan(run_dir: str | Path) -> dict:
    """What a run with a plan measured, for the search to learn from (agoq.search.calibration): its plan, its
    largest peak of any step (the GPU allocator's; None off the GPU), its median step seconds after the first, its
    steps and device. ValueError when the folder holds no run with a plan, or no step."""
    run = read_run(run_dir)
    if run is None:
        raise ValueError(f"{run_dir}: no run.json (not a run folder of agoq train)")
    plan = run.get("plan")
    if not isinstance(plan, dict) or (plan.get("source") or {}).get("method") == "policy":
        raise ValueError(f"{run_dir}: the run trained no searched plan (--plan): nothing to compare with")
    steps = []
    path = Path(run_dir) / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        row = metric_record(line)
        if row is not None and "step_seconds" in row:  # None: a line cut short by a kill
            steps.append(row)
    if not steps:
        raise ValueError(f"{run_dir}: the run has no finished step yet")
    gpu = str((run.get("hardware") or {}).get("device", "")).startswith("cuda")
    peaks = [max(p for p in s.get("peak_bytes") or [] if p is not None) for s in steps
             if any(p is not None for p in s.get("peak_bytes") or [])] if gpu else []
    timed = sorted(s["step_seconds"] for s in (steps[1:] or steps))
    return {"run": str(run_dir), "plan": plan, "steps": len(steps), "peak_bytes": max(peaks) if peaks else None,
            "step_seconds": timed[len(timed) // 2], "fingerprint": (plan.get("model") or {}).get("fingerprint")}


def read_run(run_dir: str | Path) -> dict | None:
    """RUN_DIR/run.json, or None when there is none (or it cannot be read)."""
    try:
        return json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
