"""The dashboard has no reader of agoq's files of its own: it parses no JSON, CSV or parquet and checks no schema
itself, but reads profiles, plans, runs, metrics and Pareto fronts through agoq.formats' read-only views (one
owner per format). Checked on the source (what it calls) and on a running dashboard (what it reads)."""

import ast
import json
import re
import shutil
from pathlib import Path

from fastapi.testclient import TestClient

import agoq.formats.plan
import agoq.formats.profile_header
import agoq.formats.schema
from dashboard.app import create_app

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboard"
# calls that parse a file's text; each module allowed one says why
PARSERS = {"json.loads", "json.load", "pd.read_parquet", "pd.read_csv", "pandas.read_parquet", "pandas.read_csv",
           "csv.DictReader", "csv.reader"}
SCHEMA = re.compile(r'"?agoq\.(profile|plan|run)/[0-9.]*')  # a schema or its prefix as a value (not prose about one)
ALLOWED = {("figures.py", "json.loads"): "Plotly's own figure JSON, made in memory",
           ("studies.py", "json.loads"): "Optuna's journal file, Optuna's format rather than agoq's",
           ("discovery.py", b'"agoq.plan/'): "finds plan files among JSON files by their first 4 KiB; each found is "
                                             "then read by views.read_plan"}
READERS = {"profiles.py": {"read_profile_header", "read_profile_table"}, "plans.py": {"views"},
           "runs.py": {"read_run", "metric_record"}, "searches.py": {"views"}, "origins.py": {"read_profile_header"}}


def _called(node: ast.Call) -> str:
    parts = []
    f = node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def test_no_dashboard_module_parses_files_or_schemas_itself():
    found = []
    for path in sorted(DASHBOARD.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called(node) in PARSERS and (path.name, _called(node)) not in ALLOWED:
                found.append(f"{path.name}:{node.lineno} calls {_called(node)}")
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) \
                    and SCHEMA.fullmatch(node.value if isinstance(node.value, str) else node.value.decode()) \
                    and (path.name, node.value) not in ALLOWED:
                found.append(f"{path.name}:{node.lineno} names a schema to check: {node.value!r}")
    assert not found, "the dashboard reads agoq's files through agoq.formats.views only:\n" + "\n".join(found)


def test_each_reader_imports_its_views_from_agoq_formats():
    for name, wanted in READERS.items():
        tree = ast.parse((DASHBOARD / name).read_text())
        imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module in ("agoq.formats.views", "agoq.formats") for alias in node.names}
        assert wanted <= imported, (name, wanted - imported)


def test_a_running_dashboard_reads_through_the_owners_checks(synthetic_root, tmp_path, monkeypatch):
    """Every schema check and plan validation the dashboard's answers need runs in agoq.formats: counted there, and a
    file each owner refuses is refused in the owner's words."""
    calls = {"schema": 0, "plan": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def wrapper(*a, **k):
            calls[key] += 1
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    counting(agoq.formats.schema, "check_schema", "schema")
    counting(agoq.formats.plan, "plan_from_dict", "plan")
    root = tmp_path / "root"
    shutil.copytree(synthetic_root, root)
    client = TestClient(create_app(root))
    index = client.get("/api/index").json()
    assert all("error" not in item for kind in ("profiles", "plans", "runs") for item in index[kind]), index
    assert calls["schema"] >= len(index["profiles"]) + len(index["plans"]) + len(index["runs"])
    assert calls["plan"] >= len(index["plans"])
    # files the owners refuse, in the owners' words
    profile_id = index["profiles"][0]["id"]
    header = root / profile_id / "profile.json"
    meta = json.loads(header.read_text())
    header.write_text(json.dumps({**meta, "memory": {}}))
    entry = next(p for p in client.get("/api/index", params={"refresh": True}).json()["profiles"]
                 if p["id"] == profile_id)
    try:
        agoq.formats.profile_header.check_header({**meta, "memory": {}}, "profile.json")
    except ValueError as e:
        assert entry["error"] == str(e)
    else:
        raise AssertionError("the owner should refuse a profile without memory.weights_bytes")
