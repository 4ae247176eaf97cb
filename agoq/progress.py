"""Progress bars: every bar agoq shows is made by `progress_bar`, on stderr.

On a terminal it is a tqdm bar redrawn in place. On anything else (a CI log, a file, `| tee`), where each
redraw would add to the log instead of replacing the last, it writes whole lines and rarely: nothing for
a task shorter than LOG_INTERVAL_S seconds, then at most one line per LOG_INTERVAL_S seconds and a last
one when it ends, without carriage returns or bar glyphs. That holds for every redraw, those a caller
forces too (`set_postfix`, `set_description`, `refresh` redraw at once on a terminal): a bar updated with
a postfix at every training step still writes one line a minute to a log. Off (`enabled=False`, e.g.
`--quiet`) it writes nothing at all.

tqdm's `leave` and `delay` (e.g. a search phase's bar that shows only after a second or two and is wiped
when done) apply on a terminal; a log keeps its own rules above.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional, TextIO

LOG_INTERVAL_S = 60.0  # seconds between two lines of a bar on a stream that is not a terminal
PHASE_DELAY_S = 1.0  # a phase's bar shows on a terminal once the phase has run this long
PHASE_TICK_S = 0.5   # how often a phase with no steps of its own (phase) redraws its running time
PHASE_FORMAT = "{desc}: running for {elapsed}{postfix}"
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


def _log_bar_class():
    """tqdm's bar for a stream that is not a terminal: every redraw (an update's, or one a caller forces) writes a
    line only once LOG_INTERVAL_S have passed since the bar started and since its last line; the redraw of `close`
    (a bar that wrote a line) always does. Made on first use, so that importing agoq.progress imports no tqdm."""
    from tqdm import tqdm

    class LogBar(tqdm):
        @property
        def format_dict(self):  # set_description keeps "desc: ", which LOG_FORMAT's "{desc}: " would double
            d = tqdm.format_dict.fget(self)
            d["prefix"] = (d.get("prefix") or "").removesuffix(": ")
            return d

        def display(self, msg=None, pos=None):
            now = self._time()
            start = getattr(self, "start_t", None)
            last = getattr(self, "_last_line_t", None)
            closing = self.disable  # close() marks the bar disabled before its last redraw
            if not closing and (start is None or now - start < LOG_INTERVAL_S
                                or (last is not None and now - last < LOG_INTERVAL_S)):
                return True
            self._last_line_t = self.last_print_t = now  # close() writes a last line only after a first one
            return super().display(msg, pos)

    return LogBar


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
    for terminal_only in ("leave", "delay", "dynamic_ncols"):
        options.pop(terminal_only, None)
    options.setdefault("bar_format", LOG_FORMAT)
    return _log_bar_class()(iterable, file=_Lines(stream), mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S,
                            delay=LOG_INTERVAL_S, ncols=None, **options)


def phase_bar(iterable: Optional[Iterable] = None, *, enabled: bool = True, stream: Optional[TextIO] = None,
              **options: Any):
    """A bar for one phase of a longer task (a search's MILP solves, its front, ...): as `progress_bar`, but on a
    terminal it shows only once the phase has run PHASE_DELAY_S and is wiped when it ends, so that a task of many
    short phases leaves only its own output; a log writes it by progress_bar's rules."""
    return progress_bar(iterable, enabled=enabled, stream=stream, leave=False, delay=PHASE_DELAY_S, **options)


@contextmanager
def phase(desc: str, *, enabled: bool = True, stream: Optional[TextIO] = None,
          tick: float = PHASE_TICK_S) -> Iterator[Any]:
    """Say that a step with no steps of its own is running (one long MILP solve, a search over a few knob
    combinations): within the `with` block a bar "DESC: running for 00:07" is redrawn every `tick` seconds by a thread
    of its own, by phase_bar's rules (on a terminal from PHASE_DELAY_S on, wiped at the end; in a log a line a minute
    and a last one, nothing for a phase done within the minute). Yields the bar (`set_postfix_str` says what it is
    at); off (`enabled=False`) it draws nothing and starts no thread."""
    bar = phase_bar(total=None, desc=desc, enabled=enabled, stream=stream, bar_format=PHASE_FORMAT)
    if not enabled:
        yield bar
        return
    stop = threading.Event()

    def redraw() -> None:
        while not stop.wait(tick):
            if bar._time() - bar.start_t >= bar.delay:  # tqdm's delay holds for updates only: here too
                bar.refresh()
                bar.last_print_t = bar._time()  # drawn: close() wipes it (or, in a log, writes its last line)

    thread = threading.Thread(target=redraw, name=f"agoq phase: {desc}", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        bar.close()
