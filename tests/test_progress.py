"""agoq.progress: bars redrawn in place on a terminal, rare whole lines elsewhere (logs, pipes), nothing when off;
the clock is simulated, so the intervals are checked exactly."""

import io
import os
import random

import pytest

from agoq.progress import LOG_INTERVAL_S, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    import tqdm.std

    c = Clock()
    monkeypatch.setattr(tqdm.std, "time", c)
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 0)  # no monitor thread reading the real clock
    return c


def run_bar(stream, clock, total, seconds_per_step, enabled=True):
    bar = progress_bar(total=total, desc="work", unit="item", stream=stream, enabled=enabled)
    for _ in range(total):
        clock.now += seconds_per_step
        bar.update(1)
    bar.close()


def expected_log_lines(total, seconds_per_step):
    """Brute force of the rule: a line at an update once LOG_INTERVAL_S have passed since the start and since the
    last line, and a last line at the end when any was written."""
    start = last = 0.0
    lines = 0
    for i in range(1, total + 1):
        t = i * seconds_per_step
        if t - start >= LOG_INTERVAL_S and t - last >= LOG_INTERVAL_S:
            lines, last = lines + 1, t
    return lines + (1 if lines else 0)


@pytest.mark.parametrize("seed", [int.from_bytes(os.urandom(4), "little") for _ in range(3)])
def test_not_a_terminal_gets_rare_whole_lines(clock, seed):
    rng = random.Random(seed)
    print("seed", seed)
    total = rng.randint(50, 400)
    short = io.StringIO()
    run_bar(short, clock, total, (LOG_INTERVAL_S * 0.9) / total)  # done within the interval: nothing at all
    assert short.getvalue() == ""
    step = rng.uniform(2.1, 9.7)  # minutes in all: a line at most every LOG_INTERVAL_S
    log = io.StringIO()
    run_bar(log, clock, total, step)
    text = log.getvalue()
    assert "\r" not in text and "█" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == expected_log_lines(total, step) and len(lines) <= total * step / LOG_INTERVAL_S + 1
    assert all(line.startswith("work: ") for line in lines)
    assert lines[-1].startswith(f"work: {total}/{total} (100%)")


def test_a_terminal_gets_a_bar_redrawn_in_place(clock):
    term = Terminal()
    run_bar(term, clock, 37, 0.5)
    assert "\r" in term.getvalue() and "37/37" in term.getvalue()


def test_off_writes_nothing_even_on_a_terminal(clock, capsys):
    term = Terminal()
    run_bar(term, clock, 23, 5.0, enabled=False)
    bar = progress_bar(range(11), desc="off", enabled=False)
    assert list(bar) == list(range(11))
    assert term.getvalue() == "" and capsys.readouterr() == ("", "")


def test_default_stream_is_stderr_when_called(clock, capsys):
    """The bar writes to sys.stderr as it is when made (pytest's capture here: not a terminal)."""
    run_bar(None, clock, 19, 2 * LOG_INTERVAL_S / 3)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith("work: 19/19") and "\r" not in err


@pytest.mark.parametrize("seed", [int.from_bytes(os.urandom(4), "little") for _ in range(2)])
def test_forced_redraws_are_throttled_in_a_log_too(clock, seed):
    """A bar given a postfix at every step (as `agoq train`'s loss) or a new description forces a redraw each time;
    in a log it still writes by the same rule as plain updates: a line once a minute, and a last one."""
    rng = random.Random(seed)
    print("seed", seed)
    total = rng.randint(50, 300)
    step = rng.uniform(0.5, 9.7)
    log = io.StringIO()
    bar = progress_bar(total=total, desc="train", unit="step", stream=log)
    for i in range(total):
        clock.now += step
        bar.update(1)
        bar.set_postfix(loss=f"{rng.random():.4f}")
        if i % 7 == 0:
            bar.set_description("train")
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == expected_log_lines(total, step), lines
    assert all(line.startswith("train: ") and "loss=" in line for line in lines)
    if lines:
        assert lines[-1].startswith(f"train: {total}/{total} (100%)")
    short = io.StringIO()  # done within the interval: nothing, however many redraws were forced
    bar = progress_bar(total=40, desc="phase", stream=short, leave=False, delay=1.0)
    for _ in range(40):
        clock.now += LOG_INTERVAL_S * 0.9 / 40
        bar.update(1)
        bar.set_postfix_str("solving")
    bar.close()
    assert short.getvalue() == ""


def test_a_log_keeps_the_last_line_of_a_bar_a_terminal_would_wipe(clock):
    """`leave=False` wipes a finished bar on a terminal; a log keeps its last line (it replaces nothing)."""
    log = io.StringIO()
    bar = progress_bar(total=3, desc="phase", stream=log, leave=False, delay=2.0)
    for _ in range(3):
        clock.now += LOG_INTERVAL_S
        bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == expected_log_lines(3, LOG_INTERVAL_S) and lines[-1].startswith("phase: 3/3 (100%)")


def _wait_for(condition, seconds=10.0):
    """Poll `condition` (a phase's redraws come from its own thread) until true or `seconds` of real time pass."""
    import time

    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)
    return condition()


def test_a_phase_shows_its_running_time_on_a_terminal_and_wipes_it(clock):
    """A phase with no steps of its own draws nothing before PHASE_DELAY_S (simulated), then its running time, and
    leaves a blank line behind when it ends."""
    from agoq.progress import PHASE_DELAY_S, phase

    term = Terminal()
    with phase("solving", stream=term, tick=0.002):
        clock.now += PHASE_DELAY_S * 0.5
        assert not _wait_for(lambda: term.getvalue(), seconds=0.05)  # not yet shown
        clock.now += PHASE_DELAY_S * 2
        ran = int(PHASE_DELAY_S * 2.5)
        shown = f"{ran // 60:02d}:{ran % 60:02d}"
        assert _wait_for(lambda: f"solving: running for {shown}" in term.getvalue())
    assert term.getvalue().endswith("\r") and term.getvalue().rstrip("\r ").endswith(shown)
    quiet = Terminal()
    with phase("solving", stream=quiet, enabled=False, tick=0.002):
        clock.now += 10 * PHASE_DELAY_S
    assert quiet.getvalue() == ""


def test_a_phase_in_a_log_writes_a_line_a_minute(clock):
    """In a log a phase done within a minute writes nothing; a longer one a line once a minute (however often it
    redraws) and a last one at the end."""
    from agoq.progress import phase

    short = io.StringIO()
    with phase("front", stream=short, tick=0.002):
        clock.now += LOG_INTERVAL_S * 0.9
        _wait_for(lambda: False, seconds=0.05)  # a few redraws
    assert short.getvalue() == ""
    log = io.StringIO()
    with phase("front", stream=log, tick=0.002):
        clock.now += LOG_INTERVAL_S + 1
        assert _wait_for(lambda: log.getvalue().count("\n") == 1)
        clock.now += LOG_INTERVAL_S * 0.5
        _wait_for(lambda: False, seconds=0.05)  # redraws within the minute: no line
        assert log.getvalue().count("\n") == 1
    lines = log.getvalue().splitlines()
    assert lines == ["front: running for 01:01", "front: running for 01:31"]
