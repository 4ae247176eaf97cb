"""Headless Chromium driven over the DevTools protocol through a pipe (--remote-debugging-pipe: JSON
messages ending in a NUL byte, read by Chromium on fd 3 and written on fd 4), so no websocket client
is needed. Collects uncaught exceptions, console errors and failed loads per page."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--mute-audio", "--hide-scrollbars", "--window-size=1400,1000",
         "--remote-debugging-pipe"]


def find_chromium() -> str | None:
    """Path of a Chromium binary (Debian's /usr/bin/chromium first), or None."""
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Chromium:
    """One headless browser with one page; `open(url)` loads it and reports what went wrong."""

    def __init__(self, binary: str, profile_dir: Path):
        to_chrome_r, self._to_chrome_w = os.pipe()
        self._from_chrome_r, from_chrome_w = os.pipe()
        high_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
        high_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)

        def child_fds() -> None:
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile_dir}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=child_fds, pass_fds=(3, 4))
        for fd in (to_chrome_r, from_chrome_w, high_r, high_w):
            os.close(fd)
        self.requested: list[str] = []  # URLs the last page loaded
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self._events: list[dict] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._stderr: list[bytes] = []
        self._stderr_reader = threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True)
        self._stderr_reader.start()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=self.session)

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._from_chrome_r, 1 << 20)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cond:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                    self._cond.notify_all()

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict[str, Any]:
        """Send one DevTools command and wait for its result."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._next_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"Chromium gave no answer to {method}: "
                                       + b"".join(self._stderr[-20:]).decode(errors="replace"))
                self._cond.wait(left)
            reply = self._replies.pop(self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, ready: str, timeout: float = 60.0) -> list[str]:
        """Load `url`, wait until the JavaScript expression `ready` is true, and return the page's
        problems: uncaught exceptions, console errors, log errors and failed requests."""
        with self._cond:
            self._events.clear()
        self.call("Page.navigate", {"url": url}, session=self.session)
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"document.readyState === 'complete' && Boolean({ready})"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(0.3)  # let late errors arrive
        problems = []
        with self._cond:
            events = list(self._events)
        self.requested = [e["params"]["request"]["url"] for e in events
                          if e.get("method") == "Network.requestWillBeSent"]
        for e in events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                problems.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "")))
            elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                problems.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                problems.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
            elif method == "Network.loadingFailed" and not p.get("canceled"):
                problems.append(f"load failed: {p.get('errorText')}")
            elif method == "Network.responseReceived" and p["response"]["status"] >= 400:
                problems.append(f"HTTP {p['response']['status']}: {p['response']['url']}")
        return problems

    def screenshot(self, path: Path) -> Path:
        """Save the whole page as a PNG."""
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                         session=self.session)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except RuntimeError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome_w)
        # both readers end at the pipes' EOF now that Chromium is gone, and their files are closed here: left to
        # the garbage collector, they are warned of in whatever later test it runs in (a helper process Chromium
        # left behind may hold a pipe open: its file then stays with its reader)
        self._reader.join(timeout=10)
        if not self._reader.is_alive():
            os.close(self._from_chrome_r)
        self._stderr_reader.join(timeout=10)
        if not self._stderr_reader.is_alive():
            self.proc.stderr.close()
