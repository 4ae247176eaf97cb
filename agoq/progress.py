"""Progress bars: every bar agoq shows is made by `progress_bar`, on stderr.

On a terminal it is a tqdm bar redrawn in place. On anything else (a CI log, a file, `| tee`), where each
redraw would add to the log instead of replacing the last, it writes whole lines and rarely: nothing for
a task shorter than LOG_INTERVAL_S seconds, then at most one line per LOG_INTERVAL_S seconds and a last
one when it ends, without carriage returns or bar glyphs. Off (`enabled=False`, e.g. `--quiet`) it
writes nothing at all.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, TextIO

LOG_INTERVAL_S = 60.0  # seconds between two lines of a bar on a stream that is not a terminal
LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def is_terminal(stream: Any) -> bool:
    """Whether `stream` is an interactive terminal (False for files, pipes and streams without isatty)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class _Lines:
    """A stream for tqdm that turns its in-place redraws ('\\r' + status + padding) into one line each."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        line = str(text).replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        getattr(self.stream, "flush", lambda: None)()


def progress_bar(iterable: Optional[Iterable] = None, *, enabled: bool = True, stream: Optional[TextIO] = None,
                 **options: Any):
    """A tqdm bar over `iterable` (or updated by hand: `total=`), on `stream` (default sys.stderr, read when
    called); `options` are tqdm's (desc, unit, total, initial, ...). See the module's docstring for how it
    writes where `stream` is not a terminal, and when `enabled` is False."""
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    if not enabled:
        return tqdm(iterable, disable=True, **options)
    if is_terminal(stream):
        return tqdm(iterable, file=stream, dynamic_ncols=True, **options)
    return tqdm(iterable, file=_Lines(stream), bar_format=LOG_FORMAT, mininterval=LOG_INTERVAL_S,
                maxinterval=LOG_INTERVAL_S, delay=LOG_INTERVAL_S, ncols=None, **options)
