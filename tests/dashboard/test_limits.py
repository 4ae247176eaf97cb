"""The dashboard's guards: JSON files over the size cap are skipped unread, a busy port is refused before
"serving" is printed, a request body over the limit is answered 413 unread, and errors quote bad input short."""

import json
import os
import random
import select
import socket
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from agoq.cli import main
from dashboard.app import create_app


def test_oversized_json_is_skipped_unread(tmp_path, monkeypatch):
    """The dashboard reads run.json through agoq.formats' view, whose size cap (agoq.files.MAX_JSON_BYTES) refuses a
    file from its size alone."""
    import agoq.files

    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "run.json"
    path.write_text(json.dumps({"schema": "agoq.run/1", "status": "finished", "pad": "x" * 5000}))
    client = TestClient(create_app(tmp_path))
    assert client.get("/api/run", params={"id": "run"}).json()["summary"]["status"] == "finished"
    monkeypatch.setattr(agoq.files, "MAX_JSON_BYTES", 4096)
    read = []
    real = type(path).read_text
    monkeypatch.setattr(type(path), "read_text", lambda self, *a, **k: read.append(self) or real(self, *a, **k))
    answer = client.get("/api/run", params={"id": "run"})
    assert answer.status_code == 422 and "run.json" in answer.text and "larger than" in answer.text
    assert path not in read  # refused from its size alone


def test_busy_port_is_refused_before_serving(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["dashboard", "--root", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "serving" not in err


# --- request bodies and what errors quote of them -------------------------------------------------------

SERVE = """
import socket, sys
import uvicorn
from dashboard.app import create_app
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(create_app(sys.argv[1]), log_level="warning")).run(sockets=[sock])
"""


def _peak_rss_kib(pid: int) -> int:
    """The highest resident memory the process has had (VmHWM), KiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _post_huge(port: int, total: int, chunked: bool, timeout: float = 30.0) -> tuple[bytes, int, float]:
    """POST `total` bytes of JSON-looking body to /api/plan (declared by Content-Length, or chunked), sending
    only while the server has not answered; returns (the answer, bytes of body sent, seconds to the answer)."""
    piece = b"[" + b"1," * 2**18
    if chunked:
        piece = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    head = (b"POST /api/plan HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + (b"Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {total}\r\n\r\n".encode()))
    answer, sent = b"", 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        start = time.monotonic()
        sock.sendall(head)
        sock.setblocking(False)
        while b"\r\n\r\n" not in answer and time.monotonic() - start < timeout:
            readable, writable, _ = select.select([sock], [sock] if sent < total else [], [], timeout)
            if readable:
                try:
                    data = sock.recv(65536)
                except ConnectionError:
                    break
                if not data:
                    break
                answer += data
            elif writable:
                try:
                    sent += sock.send(piece)
                except (BlockingIOError, ConnectionError):
                    pass
        seconds = time.monotonic() - start
        sock.setblocking(True)
        try:
            while data := sock.recv(65536):
                answer += data
        except (ConnectionError, socket.timeout):
            pass
    return answer, sent, seconds


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's peak memory from /proc")
def test_a_huge_body_is_413_unread(tmp_path, seed):
    """A body of ~50 MB to a real server: 413 before most of it is sent, whether it declares its length or comes
    chunked, the rest never read, and the server's peak memory does not grow with it (it grew by ~300 MB when it read the
    body whole)."""
    rng = random.Random(seed)
    total = 50 * 2**20 + rng.randrange(1, 2**20)
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        small, _, _ = _post_huge(port, 1000, chunked=False)  # a small one first: the server has served a request
        assert small.startswith(b"HTTP/1.1 4"), small[:200]
        before = _peak_rss_kib(server.pid)
        for chunked in (False, True):
            answer, sent, seconds = _post_huge(port, total, chunked)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413"), (chunked, answer[:300])
            # the server closes with the rest of the body unread, so a reset may cut its short answer off the
            # socket here; what does arrive is that answer, never an echo of the body
            assert len(body) < 400 and (not body or b"65536 bytes" in body), (chunked, body[:400])
            # answered before most of the body was sent (the kernel's socket buffers hold several MB of it)
            assert sent < total // 2, (chunked, seconds, sent)
        grown = _peak_rss_kib(server.pid) - before
        assert grown < 16 * 1024, f"the server's peak memory grew by {grown} KiB for a {total}-byte body"
        assert _post_huge(port, 1000, chunked=False)[0].startswith(b"HTTP/1.1 4")  # and it still answers
    finally:
        server.terminate()
        server.wait(timeout=30)
        server.stdout.close()


def test_bodies_up_to_the_limit_are_read(tmp_path):
    from dashboard.limits import MAX_BODY_BYTES

    client = TestClient(create_app(tmp_path))
    body = json.dumps({"profile": "absent", "budget": "1GiB"})
    for size, status in [(MAX_BODY_BYTES, 404), (MAX_BODY_BYTES + 1, 413)]:
        padded = body[:-1] + " " * (size - len(body)) + "}"  # JSON with blanks: a body of exactly `size` bytes
        r = client.post("/api/plan", content=padded, headers={"content-type": "application/json"})
        assert r.status_code == status, (size, r.text[:200])
        chunks = (padded[i:i + 999].encode() for i in range(0, size, 999))  # no Content-Length: chunked
        r = client.post("/api/plan", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == status, (size, r.text[:200])
        if status == 413:  # says the limit, and quotes nothing of the body
            assert f"{MAX_BODY_BYTES} bytes" in r.text and len(r.text) < 400, r.text[:400]


@pytest.mark.parametrize("what", ["budget text", "budget list", "cap", "objective", "profile", "extra field",
                                  "extra fields", "save name", "bad json"])
def test_errors_quote_a_short_excerpt(what, tmp_path):
    """Bad input of ~60 kB (under the body limit) is answered 4xx in well under a kilobyte, quickly."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    n = 60_000 + rng.randrange(1000)
    long = "".join(rng.choice("abcdefgh") for _ in range(n))
    base = {"profile": "prof", "budget": "1GiB"}
    body = {"budget text": {**base, "budget": "9" * n + "x"},
            "budget list": {**base, "budget": list(range(n // 8))},
            "cap": {**base, "time_cap": long},
            "objective": {**base, "objective": long},
            "profile": {**base, "profile": long},
            "extra field": {**base, long: 1},
            "extra fields": {**base, **{f"x{i}": i for i in range(n // 16)}},
            "save name": {**base, "name": long},
            "bad json": None}[what]
    client = TestClient(create_app(tmp_path), client=("127.0.0.1", 50000))
    path = "/api/plan/save" if what == "save name" else "/api/plan"
    content = "{" + long if body is None else json.dumps(body)
    start = time.monotonic()
    r = client.post(path, content=content, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500 and r.status_code != 413, (r.status_code, r.text[:300])
    assert len(content) > 40_000
    assert len(r.content) < 2000, (what, len(r.content), r.text[:300])
    assert time.monotonic() - start < 5


def test_names_not_found_are_repeated_short(tmp_path):
    """An unknown id of ~10 kB in a query (under the server's 16 KiB request line) is a 404 that repeats its
    start only, on the API and on the pages."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    long = "".join(rng.choice("abcdefgh/") for _ in range(10_000 + rng.randrange(1000)))
    client = TestClient(create_app(tmp_path))
    for path in ("/api/profile", "/api/plan", "/api/run", "/profile", "/plan"):
        r = client.get(path, params={"id": long})
        assert r.status_code == 404, (path, r.text[:200])
        assert long[:200] in r.text and long[:201] not in r.text and f"({len(long)} characters)" in r.text
