"""What a run leaves in RUN_DIR: run.json (rewritten atomically as the run goes) and metrics.jsonl (appended).

See docs/formats.md ("Run"). Only rank 0 writes.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from agoq.files import json_safe, write_atomic, write_json

RUN_SCHEMA = "agoq.run/1"


def now_iso() -> str:
    """The current UTC time, ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class RunRecord:
    """run.json and metrics.jsonl of one run folder."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.run_path = self.dir / "run.json"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.run: dict[str, Any] = {}

    def existing(self) -> dict | None:
        """The run.json already in the folder, or None."""
        try:
            return json.loads(self.run_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def start(self, run: dict[str, Any], resumed_from: int | None) -> None:
        """Write run.json with status "running"; on resume keep `started` and drop metrics after the checkpoint."""
        self.dir.mkdir(parents=True, exist_ok=True)
        old = self.existing()
        started = old.get("started") if (resumed_from is not None and old) else None
        self.run = {"schema": RUN_SCHEMA, **run, "status": "running", "started": started or now_iso(),
                    "updated": now_iso(), "step": resumed_from or 0, "message": None}
        if resumed_from is not None:
            self.run["resumed"] = (old or {}).get("resumed", []) + [{"step": resumed_from, "date": now_iso()}]
        write_json(self.run_path, json_safe(self.run))
        self.truncate_metrics(resumed_from or 0)

    def truncate_metrics(self, step: int) -> None:
        """Keep only metric lines up to and including `step` (lines written after the last checkpoint go)."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a kill
        write_atomic(self.metrics_path, "".join(k + "\n" for k in kept))

    def update(self, step: int, status: str = "running", message: str | None = None) -> None:
        """Rewrite run.json with the current step, status and message."""
        self.run.update(step=step, status=status, message=message, updated=now_iso())
        write_json(self.run_path, json_safe(self.run))

    def append(self, record: dict[str, Any]) -> None:
        """Append one line to metrics.jsonl and flush it (a killed process leaves at most a cut last line)."""
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")
            f.flush()
