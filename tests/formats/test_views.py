"""The read-only views of agoq's files (agoq.formats.views): a good file comes back as written (the reference: the JSON
the owner's writer put there, read back with json), and a broken one (another schema kind, a newer major version, a
missing field, a file over the size cap) is a FormatError naming the file and the field; the views refuse exactly
what the owners' own readers (load_profile, load_plan) refuse."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import agoq.files
from agoq.files import json_safe
from agoq.formats import views
from agoq.formats.pareto import COLUMNS, pareto_csv
from agoq.formats.plan import load_plan
from agoq.formats.profile import load_profile
from agoq.formats.run import RunRecord
from agoq.formats.views import FormatError
from tests.dashboard import synthetic

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "agoq" / "examples" / "profiles" / "probe-h100"


def fresh_rng() -> np.random.Generator:
    return np.random.default_rng(random.getrandbits(32))  # seeded per test: tests/conftest.py


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def refused(read, path: Path, *words: str) -> str:
    """read(path, where=NAME) raises FormatError; its message names NAME and holds every one of `words`."""
    name = f"shown-{random.getrandbits(16)}.json"
    with pytest.raises(FormatError) as e:
        read(path, where=name)
    message = str(e.value)
    assert name in message and str(path) not in message, message  # the file as the caller names it
    for word in words:
        assert word in message, (word, message)
    return message


def a_run(tmp_path: Path, rng) -> Path:
    """run.json as agoq train's RunRecord writes it."""
    record = RunRecord(tmp_path / "run")
    record.start({"model": {"name": "m", "fingerprint": "0123456789abcdef"}, "settings": {"steps": int(rng.integers(9, 99))},
                  "world": {"size": 1}, "plan": None}, resumed_from=None)
    record.update(int(rng.integers(1, 9)), status="finished")
    return record.run_path


# --- good files come back as written ---------------------------------------------------------------------------

def test_good_files_read_as_written(tmp_path):
    rng = fresh_rng()
    header = PROBE / "profile.json"
    assert views.read_profile_header(header) == json.loads(header.read_text())
    plan = synthetic.make_plan(rng, int(rng.integers(2, 9)), "0123456789abcdef", stages=int(rng.integers(1, 3)))
    path = write(tmp_path / "plan.json", plan)
    assert views.read_plan(path) == plan
    load_plan(path)  # the owner takes it too
    run = a_run(tmp_path, rng)
    assert views.read_run(run) == json.loads(run.read_text())
    table = views.read_profile_table(PROBE / "profile.parquet", ("layer", "kind", "option"))
    assert table.equals(pd.read_parquet(PROBE / "profile.parquet"))


def test_metric_lines_are_read_as_appended(tmp_path):
    rng = fresh_rng()
    record = RunRecord(tmp_path)
    written = []
    for step in range(1, int(rng.integers(3, 12))):
        rec = {"step": step, "loss": float(rng.uniform(1, 5)), "peak_bytes": [int(rng.integers(1, 2**30)), None],
               "time": float(rng.uniform(0, 1e9))}
        if rng.random() < 0.3:
            rec["loss"] = float("nan")  # written as null
        record.append(rec)
        written.append(json_safe(rec))
    lines = record.metrics_path.read_text().splitlines()
    assert [views.metric_record(line) for line in lines] == written
    assert views.metric_record(lines[-1][: len(lines[-1]) // 2]) is None  # cut short by a kill
    for garbage in ("garbage", "[1, 2]", '{"no_step": 1}', '{"step": "3"}', '{"step": true}', '{"step": 1.5}',
                    '{"step": Infinity}', ""):
        assert views.metric_record(garbage) is None, garbage
    assert views.metric_record(b'{"step": 4, "val_loss": 2.5}') == {"step": 4, "val_loss": 2.5}


def test_the_pareto_csv_reads_back_what_was_written(tmp_path):
    rng = fresh_rng()
    rows = []
    for i in range(int(rng.integers(1, 6))):
        row = {c: None for c in COLUMNS}
        row.update(source="optuna", trial=i, budget_bytes=int(rng.integers(1, 2**34)),
                   predicted_peak_bytes=int(rng.integers(1, 2**34)), predicted_step_seconds=float(rng.uniform(0, 2)),
                   predicted_grad_error=float(rng.uniform(0, 1)), format="int", plan=f"plan-pareto/optuna-{i:02d}.json",
                   measured_step_seconds=float("nan") if rng.random() < 0.5 else float(rng.uniform(0, 2)))
        rows.append(row)
    path = tmp_path / "plan.pareto.csv"
    path.write_text(pareto_csv(rows))
    front = views.read_pareto(path)
    assert front["columns"] == COLUMNS
    expected = [{k: (float(v) if isinstance(v, (int, float)) and v == v else (None if v != v or v is None else v))
                 for k, v in row.items()} for row in rows]
    assert front["rows"] == expected
    path.write_text("a,predicted_peak_bytes\n1,2\n")
    refused(views.read_pareto, path, "missing column(s) predicted_step_seconds, predicted_grad_error")


# --- broken files are refused, naming the file and the field ----------------------------------------------------

def test_a_broken_profile_header_names_the_file_and_the_field(tmp_path):
    header = json.loads((PROBE / "profile.json").read_text())
    path = tmp_path / "profile.json"
    for schema, words in [("agoq.run/1", ("schema", "'agoq.run/1'", "not a profile schema")),
                          ("agoq.profile/2", ("schema", "newer than this agoq reads", "upgrade agoq")),
                          (None, ("schema", "missing"))]:
        refused(views.read_profile_header, write(path, {**header, "schema": schema}), *words)
    assert views.read_profile_header(write(path, {**header, "schema": "agoq.profile/1.9"}))["schema"] == \
        "agoq.profile/1.9"  # a newer minor version is read
    memory = {k: v for k, v in header["memory"].items() if k != "weights_bytes"}
    refused(views.read_profile_header, write(path, {**header, "memory": memory}), "memory.weights_bytes", "missing")
    refused(views.read_profile_header, write(path, {k: v for k, v in header.items() if k != "settings"}),
            "'settings' section is missing")
    refused(views.read_profile_header, write(path, {**header, "files": {"table": "../x.parquet"}}),
            "files.table", "plain file name")
    refused(views.read_profile_header, write(path, {**header, "files": ["profile.parquet"]}), "files", "object")
    refused(views.read_profile_header, write(path, {**header, "pipeline": "one"}), "pipeline", "object")


def test_a_broken_plan_names_the_file_and_the_field(tmp_path):
    rng = fresh_rng()
    plan = synthetic.make_plan(rng, int(rng.integers(2, 9)), "0123456789abcdef")
    path = tmp_path / "plan.json"
    refused(views.read_plan, write(path, {**plan, "schema": "agoq.profile/1"}), "schema", "not a plan schema")
    refused(views.read_plan, write(path, {**plan, "schema": "agoq.plan/2.0"}), "schema", "newer than this agoq reads",
            "upgrade agoq")
    refused(views.read_plan, write(path, {k: v for k, v in plan.items() if k != "layers"}), "layers", "required")
    refused(views.read_plan, write(path, {**plan, "layers": "none"}), "layers")
    layer = int(rng.integers(len(plan["layers"])))
    bad = json.loads(json.dumps(plan))
    bad["layers"][layer]["kinds"]["norm_input"] = "recompute"
    refused(views.read_plan, write(path, bad), f"layers[{layer}].kinds", "norm_input")


def test_a_broken_run_names_the_file_and_the_field(tmp_path):
    run = json.loads(a_run(tmp_path, fresh_rng()).read_text())
    path = tmp_path / "run.json"
    refused(views.read_run, write(path, {**run, "schema": "agoq.plan/1"}), "schema", "not a run schema")
    refused(views.read_run, write(path, {**run, "schema": "agoq.run/3"}), "schema", "newer", "upgrade agoq")
    refused(views.read_run, write(path, {k: v for k, v in run.items() if k != "status"}), "status", "missing")
    refused(views.read_run, write(path, {**run, "settings": "fast"}), "settings", "must be an object")
    refused(views.read_run, write(path, {**run, "step": "7"}), "step", "integer")


def test_a_broken_profile_table_names_the_file(tmp_path):
    table = pd.read_parquet(PROBE / "profile.parquet")
    path = tmp_path / "profile.parquet"
    table.drop(columns=["sensitivity"]).to_parquet(path)
    def read(p, where):
        return views.read_profile_table(p, ("layer", "sensitivity"), where=where)

    refused(read, path, "missing column(s) sensitivity")
    path.write_bytes(b"PAR1 not parquet")
    refused(views.read_profile_table, path, "cannot read it as parquet")
    refused(views.read_profile_table, tmp_path / "profile.csv", "missing")
    table.to_csv(tmp_path / "profile.csv", index=False)  # as agoq writes it where it has no pyarrow
    assert views.read_profile_table(tmp_path / "profile.csv", ("layer", "sensitivity")).equals(
        pd.read_csv(tmp_path / "profile.csv"))


@pytest.mark.parametrize("read", [views.read_profile_header, views.read_plan, views.read_run])
def test_unreadable_and_oversized_json_is_refused_unread(tmp_path, monkeypatch, read):
    path = tmp_path / "file.json"
    refused(read, path, "missing")
    refused(read, write(path, [1, 2]), "must hold a JSON object, got list")
    path.write_text("{ not json")
    refused(read, path, "not valid JSON")
    path.write_text(json.dumps({"schema": "x", "pad": "x" * 5000}))
    monkeypatch.setattr(agoq.files, "MAX_JSON_BYTES", 4096)
    read_texts = []
    real = type(path).read_text
    monkeypatch.setattr(type(path), "read_text", lambda self, *a, **k: read_texts.append(self) or real(self, *a, **k))
    refused(read, path, "larger than")
    assert path not in read_texts  # refused from its size alone


def test_the_views_refuse_what_the_owners_refuse(tmp_path):
    """On randomly damaged copies of a good profile header and plan, a view raises exactly when the owner's reader
    (load_profile, load_plan) does."""
    rng = fresh_rng()
    header = json.loads((PROBE / "profile.json").read_text())
    plan = synthetic.make_plan(rng, 4, "0123456789abcdef")
    folder = tmp_path / "profile"
    shutil.copytree(PROBE, folder)

    def damaged(data: dict) -> dict:
        out = json.loads(json.dumps(data))
        key = sorted(out)[int(rng.integers(len(out)))]
        section = out[key]
        if isinstance(section, dict) and section and rng.random() < 0.7:
            del section[sorted(section)[int(rng.integers(len(section)))]]
        elif rng.random() < 0.5:
            del out[key]
        else:
            out[key] = ["not", "an", "object"]
        return out

    decided = set()
    for _ in range(16):
        write(folder / "profile.json", damaged(header))
        owner = _raises(lambda: load_profile(folder))
        assert _raises(lambda: views.read_profile_header(folder / "profile.json")) == owner
        decided.add(owner)
        write(tmp_path / "plan.json", damaged(plan))
        owner = _raises(lambda: load_plan(tmp_path / "plan.json"))
        assert _raises(lambda: views.read_plan(tmp_path / "plan.json")) == owner
        decided.add(owner)
    assert True in decided  # some damage is refused (deleting a section's key or a section almost always is)


def _raises(fn) -> bool:
    try:
        fn()
    except ValueError:
        return True
    return False
