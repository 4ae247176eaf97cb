"""A run that says "running" but shows no sign of life (heartbeat, updated time, file times) is stale."""

import datetime
import json
import os
import time

from dashboard.discovery import Folder
from dashboard.runs import STALE_SECONDS, run_status


def _run(tmp_path, status, heartbeat_age, file_age):
    folder = tmp_path / f"r{status}{heartbeat_age}{file_age}"
    folder.mkdir()
    now = time.time()
    beat = datetime.datetime.fromtimestamp(now - heartbeat_age, datetime.timezone.utc).isoformat()
    meta = {"schema": "agoq.run/1", "status": status, "heartbeat": beat, "updated": beat}
    for name, text in (("run.json", json.dumps(meta)), ("metrics.jsonl", "")):
        (folder / name).write_text(text)
        os.utime(folder / name, (now - file_age, now - file_age))
    return meta, Folder(folder, tmp_path), now


def test_stale_only_when_every_sign_is_old(tmp_path):
    old, fresh = STALE_SECONDS + 37, 5
    meta, folder, now = _run(tmp_path, "running", old, old)
    assert run_status(meta, folder, now) == "stale"
    meta, folder, now = _run(tmp_path, "running", fresh, old)  # heartbeat recent
    assert run_status(meta, folder, now) == "running"
    meta, folder, now = _run(tmp_path, "running", old, fresh)  # metrics still growing
    assert run_status(meta, folder, now) == "running"
    meta, folder, now = _run(tmp_path, "finished", old, old)  # an ended run is what it says
    assert run_status(meta, folder, now) == "finished"
