"""Reading an Optuna study without ever writing to it: a SQLite file is opened through a read-only
`file:` URI (mode=ro, so SQLite itself refuses any write), a journal file through a backend whose
append refuses to run."""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from agoq.files import json_safe
from agoq.formats.views import FormatError
from dashboard.formats import number

MAX_TRIALS = 5000


def _journal_backend(path: Path):
    from optuna.storages.journal import BaseJournalBackend

    class ReadOnlyJournal(BaseJournalBackend):
        """Optuna's journal log read straight from the file; appending is refused."""

        def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
            logs = []
            with open(path, "rb") as f:
                for number_, line in enumerate(f):
                    if number_ < log_number_from:
                        continue
                    if not line.endswith(b"\n"):
                        break  # a line still being written
                    try:
                        logs.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise FormatError(f"{path.name}: line {number_ + 1} is not valid JSON") from None
            return logs

        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            raise PermissionError("the dashboard never writes to a study")

    return ReadOnlyJournal()


def open_storage(path: Path):
    """An Optuna storage over `path` (study.db or study.journal) that cannot write."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if path.suffix == ".journal":
        return optuna.storages.JournalStorage(_journal_backend(path))
    uri = "file:" + urllib.parse.quote(str(path)) + "?mode=ro"

    def connect():
        return sqlite3.connect(uri, uri=True, check_same_thread=False)

    return optuna.storages.RDBStorage("sqlite://", engine_kwargs={"creator": connect},
                                      skip_compatibility_check=True, skip_table_creation=True)


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def read_studies(path: Path) -> list[dict[str, Any]]:
    """Every study in the file: name, directions, objective names, trial counts by state, and its
    finished trials (number, values, params, user attributes; at most MAX_TRIALS, the latest).
    Cached until the file (or its SQLite write-ahead log) changes."""
    key = (_stat(path), _stat(path.with_name(path.name + "-wal")))
    return _read_studies(str(path), key)


@lru_cache(maxsize=16)
def _read_studies(name: str, key: tuple) -> list[dict[str, Any]]:
    path = Path(name)
    try:
        storage = open_storage(path)
        out = []
        for frozen in storage.get_all_studies():
            trials = storage.get_all_trials(frozen._study_id, deepcopy=False)
            states: dict[str, int] = {}
            for t in trials:
                states[t.state.name] = states.get(t.state.name, 0) + 1
            done = [t for t in trials if t.state.name == "COMPLETE"][-MAX_TRIALS:]
            names = frozen.system_attrs.get("study:metric_names") or frozen.user_attrs.get("metric_names")
            out.append(json_safe({
                "name": frozen.study_name,
                "directions": [d.name.lower() for d in frozen.directions],
                "objectives": names,
                "states": states,
                "trials": [{"number": t.number, "values": [number(v) for v in (t.values or [])],
                            "params": t.params, "user_attrs": t.user_attrs} for t in done],
            }))
        return out
    except FormatError:
        raise
    except Exception as e:  # sqlite/sqlalchemy/optuna errors on a damaged or foreign file
        raise FormatError(f"{path.name}: cannot read it as an Optuna study ({type(e).__name__}: {e})") from None
