"""The dashboard's guards: JSON files over the size cap are skipped unread, a busy port is refused before
"serving" is printed."""

import json
import socket

import pytest

from agoq.cli import main
from dashboard import formats


def test_oversized_json_is_skipped_unread(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema": "agoq.plan/1", "pad": "x" * 5000}))
    assert formats.read_json(path, "plan")["schema"] == "agoq.plan/1"
    monkeypatch.setattr(formats, "MAX_JSON_BYTES", 4096)
    read = []
    monkeypatch.setattr(type(path), "read_text", lambda self, *a, **k: read.append(self) or "{}")
    with pytest.raises(formats.BrokenFile, match="larger than"):
        formats.read_json(path, "plan")
    assert read == []  # refused from its size alone


def test_busy_port_is_refused_before_serving(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["dashboard", "--root", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "serving" not in err
