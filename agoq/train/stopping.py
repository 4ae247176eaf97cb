"""Stopping a run on SIGINT / SIGTERM at a step boundary, and the lock that keeps one writer per run folder.

`StopSignals` replaces the two handlers for the run's life (main thread only; elsewhere Python cannot
install handlers and the default behaviour stays). The first signal only records itself: the step in
progress runs to its end, then the trainer saves a checkpoint there and stops (status "stopped", exit
130), so a resumed run continues exactly where this one left off. A second signal stops at once
(KeyboardInterrupt), keeping the last checkpoint written before it. Nothing is printed from the handler
(printing there can collide with a write the main thread is in the middle of).

`RunLock` takes an exclusive, non-blocking `fcntl.flock` on `RUN_DIR/.lock` and writes the holder's pid
and host into it; the operating system drops the lock when the process ends, however it ends.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOCK_NAME = ".lock"


class StopSignals:
    """Context manager: SIGINT and SIGTERM ask the run to stop at the next step boundary (see the module)."""

    def __init__(self):
        self.received: int | None = None  # the first signal's number, once one came
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second one: stop now
            raise KeyboardInterrupt(f"signal {signum}")
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class RunFolderBusy(ValueError):
    """Another live process holds the run folder's lock."""


class RunLock:
    """An exclusive lock on a run folder, held from `acquire` until `release` or the process's end."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.path = self.dir / LOCK_NAME
        self._fd: int | None = None

    def holder(self) -> str:
        """'pid N on HOST' as the holder wrote it (it writes it right after locking: read a few times)."""
        for _ in range(20):
            try:
                text = self.path.read_text().strip()
            except OSError:
                text = ""
            if text:
                return text
            time.sleep(0.05)
        return "an unknown pid"

    def acquire(self) -> None:
        """Take the lock or raise RunFolderBusy naming the folder and the holder."""
        import fcntl

        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderBusy(f"{self.dir} is in use by another agoq train ({self.holder()}): one process "
                                "writes a run folder at a time; wait for it to end or give another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays: removing it could let two processes lock two different files)."""
        if self._fd is not None:
            import fcntl

            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


__all__ = ["StopSignals", "RunLock", "RunFolderBusy", "LOCK_NAME", "STOP_SIGNALS"]
