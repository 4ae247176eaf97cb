"""The live policy search behind `POST /api/plan`: one plan per (profile, budget, caps), solved by the
same call `agoq search` makes, in a bounded pool of worker threads so no solve blocks the server.

- The request is read by `agoq search`'s own argument parser (budget sizes such as "4GB", the caps'
  words "checkpoint" / "recipe" / "none"), and every option it fills in that `agoq.search.search`
  takes is passed on, so the plan follows the command's defaults when they change. The service only
  fixes what serves one budget: the MILP at the asked budget, no Pareto front, no validation runs.
- Threads, not processes: scipy's HiGHS releases the GIL while it solves, so two solves in two threads
  take about the time of one and the event loop keeps answering meanwhile (measured on a 2-core CPU:
  six 24-layer solves 6.4 s in a row, 3.4 s on two threads, 15 s on two spawned processes).
- A solve that is running cannot be stopped: a request that waits longer than the timeout is told so
  (TimeoutError -> 504) while the solve goes on and its result is kept for the next ask. Identical
  requests in flight share one solve.
- Warm start: per profile folder (keyed by its path and its files' modification times and sizes) the
  checked profile, the built choice problem and its budget range are kept; results are kept in an LRU
  keyed by (profile, its files, budget, caps).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from agoq.units import format_bytes, format_bytes_apart, parse_size

MAX_BUDGET_BYTES = 2**50  # 1 PiB per GPU: anything above is a typo, not a GPU
CAP_FIELDS = ("objective", "time_cap", "error_cap")
# what the service itself decides, whatever `agoq search` would do: one MILP plan at the asked budget
SERVICE_FIXED = {"method": "milp", "front_budgets": 0, "validate": 0, "measure_trials": False, "ray_address": None,
                 "storage": None, "out_dir": None, "progress": False, "parallel": 1, "stop_after": None}


class Busy(Exception):
    """Every worker is solving and the queue is full; `retry_after` is seconds worth waiting."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Infeasible(ValueError):
    """No plan fits the budget under the caps; `smallest_budget` (bytes) is the least that fits, or None when
    no budget does (the caps themselves cannot be met)."""

    def __init__(self, message: str, smallest_budget: Optional[int]):
        super().__init__(message)
        self.smallest_budget = smallest_budget


class _RefusingParser(argparse.ArgumentParser):
    """`agoq search`'s parser that raises ValueError where the command line would exit."""

    def error(self, message: str):
        raise ValueError(message)


def search_parser() -> argparse.ArgumentParser:
    """A fresh parser with exactly `agoq search`'s arguments and defaults."""
    from agoq.commands import search as search_command

    parser = _RefusingParser(prog="agoq search", add_help=False)
    search_command.configure(parser)
    return parser


def cli_defaults() -> dict[str, Any]:
    """`agoq search`'s current defaults of the objective and the caps, and the objectives it offers."""
    parser = search_parser()
    out = {name: parser.get_default(name) for name in CAP_FIELDS}
    objective = next((a for a in parser._actions if a.dest == "objective"), None)
    out["objectives"] = list(objective.choices) if objective is not None and objective.choices else []
    return out


def parse_budget(value: Any) -> int:
    """Bytes per GPU from a number of bytes or a size such as "4GB", "30GiB", "1.5e9"; ValueError saying
    what is wrong when it is not a size, not positive, or above MAX_BUDGET_BYTES."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"budget: expected bytes (a number) or a size such as 30GiB or 4GB, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"budget: expected a finite number of bytes, got {value}")
        value = int(round(value))
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"budget: must be more than 0 bytes, got {value}")
        budget = value
    else:
        text = str(value).strip()
        if text.startswith("-"):
            raise ValueError(f"budget: must be more than 0 bytes, got {value!r}")
        budget = parse_size(text)  # ValueError naming the accepted forms
        if budget <= 0:
            raise ValueError(f"budget: must be more than 0 bytes, got {value!r}")
    if budget > MAX_BUDGET_BYTES:
        raise ValueError(f"budget: {format_bytes(budget)} per GPU is more than any GPU holds (at most "
                         f"{format_bytes(MAX_BUDGET_BYTES)}); give the memory of one GPU, e.g. 80GB")
    return budget


def _cap_text(name: str, value: Any) -> Optional[str]:
    """A cap as `agoq search` reads it from the command line; None when not given (the command's default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name}: expected a number or a word as `agoq search` takes it, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return repr(value) if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class PlanQuery:
    """One question to the search, read by `agoq search`'s parser: `budget_bytes` per GPU (stage), the
    objective and caps as the command holds them (defaults filled in), and the keyword arguments of
    `agoq.search.search` they make."""

    budget_bytes: int
    caps: tuple  # ((name, value), ...) in CAP_FIELDS order, as `agoq search` parsed them
    search_kwargs: tuple  # ((name, value), ...) passed to agoq.search.search besides SERVICE_FIXED

    @classmethod
    def read(cls, budget: Any, objective: Any = None, time_cap: Any = None, error_cap: Any = None) -> "PlanQuery":
        """The query of a request; ValueError saying what is wrong (with `agoq search`'s own words)."""
        from agoq.search.search import search

        budget_bytes = parse_budget(budget)
        argv = ["--profile", "-", "--budget", str(budget_bytes), "--out", "plan.json"]
        for name, value in (("objective", objective), ("time_cap", time_cap), ("error_cap", error_cap)):
            text = _cap_text(name, value)
            if text is not None:
                argv += ["--" + name.replace("_", "-"), text]
        args = search_parser().parse_args(argv)
        takes = inspect.signature(search).parameters
        kwargs = {k: v for k, v in sorted(vars(args).items())
                  if k in takes and k not in SERVICE_FIXED and k not in ("profile", "budget")}
        caps = tuple((name, getattr(args, name, None)) for name in CAP_FIELDS)
        return cls(budget_bytes, caps, tuple(kwargs.items()))


def folder_signature(folder: Path) -> tuple:
    """(name, mtime ns, size) of every file directly in `folder`: changes whenever the profile is rewritten."""
    out = []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.is_file():
                st = e.stat()
                out.append((e.name, st.st_mtime_ns, st.st_size))
    return tuple(sorted(out))


class ProfileEntry:
    """A profile folder as the search reads it, with its built choice problem and budget range, kept while
    the folder's files stay the same."""

    def __init__(self, folder: Path):
        from agoq.formats.profile import load_profile
        from agoq.search.costs import build_problem

        self.folder = folder
        self.profile = load_profile(folder)
        self.problem = build_problem(self.profile)
        self._range: Optional[dict] = None
        self._lock = threading.Lock()

    def budget_range(self) -> dict[str, Any]:
        """The budgets worth asking about, in bytes per GPU: from the smallest any plan of the search's knob
        space fits (no caps) to the largest peak of a plan that keeps everything (more buys nothing)."""
        with self._lock:
            if self._range is None:
                from agoq.search.knobs import budget_bounds

                smallest, largest = budget_bounds(self.profile)
                self._range = {"smallest_budget_bytes": smallest, "largest_budget_bytes": largest}
            return dict(self._range)


def _smallest_budget(error: BaseException) -> tuple[bool, Optional[int]]:
    """Whether `error` (or what it was raised from) is the search's InfeasibleBudget, and its smallest budget."""
    from agoq.search.milp import InfeasibleBudget

    seen = error
    while seen is not None:
        if isinstance(seen, InfeasibleBudget):
            return True, seen.smallest_budget
        seen = seen.__cause__ or seen.__context__
    return False, None


def tokens_per_step(plan: dict[str, Any]) -> int:
    """Tokens one optimizer step of the plan trains on: micro-batch x sequence x accumulation x data ranks."""
    training = plan.get("training") or {}
    launch = plan.get("launch") or {}
    ranks = int(launch.get("processes") or 1) if launch.get("parallel") in ("ddp", "sharded") else 1
    return int(training.get("micro_batch", 1)) * int(training.get("seq_len", 1)) * \
        int(training.get("grad_accum", 1)) * ranks


def plan_at_budget(entry: ProfileEntry, query: PlanQuery) -> dict[str, Any]:
    """The plan `agoq search` writes for `query` on the entry's profile, with its predicted figures:
    {plan, predicted: {peak_bytes, peak_bytes_per_stage, step_seconds, tokens_per_step, tokens_per_second,
    grad_error}, alternative, notes}. Infeasible when no plan fits the budget under the caps."""
    from agoq.search.search import search

    try:  # the query's options were already kept to those search() takes (PlanQuery.read)
        outcome = search(entry.profile, query.budget_bytes, **dict(query.search_kwargs), **SERVICE_FIXED)
    except ValueError as e:
        infeasible, smallest = _smallest_budget(e)
        if infeasible:
            text = str(e).replace(f" (profile {entry.profile.path})", "")
            if smallest is not None:
                asked, least = format_bytes_apart(query.budget_bytes, smallest)
                text = (f"no plan fits {asked} ({query.budget_bytes} bytes) per GPU under these caps: the smallest "
                        f"budget that fits is {least} ({smallest} bytes); ask for that much or more, or loosen the caps")
            raise Infeasible(text, smallest) from None
        raise
    plan = outcome.plan.to_dict()
    pred = plan["predicted"]
    tokens = tokens_per_step(plan)
    step = pred.get("step_seconds")
    predicted = {"peak_bytes": max(pred["peak_bytes_per_stage"]), "peak_bytes_per_stage": pred["peak_bytes_per_stage"],
                 "step_seconds": step, "tokens_per_step": tokens,
                 "tokens_per_second": pred.get("tokens_per_second") or (tokens / step if step else None),
                 "grad_error": pred.get("grad_error")}
    return {"plan": plan, "predicted": predicted, "alternative": plan.get("alternative"),
            "notes": list(dict.fromkeys(str(n) for n in outcome.notes))}


class Planner:
    """A bounded pool of plan solves: `workers` threads, at most `queue` requests waiting beyond those
    running (more are refused with Busy), `timeout` seconds a request waits for its plan; the last
    `cache_size` results and `profiles` profile folders are kept."""

    def __init__(self, workers: int = 2, queue: int = 16, timeout: float = 30.0, cache_size: int = 256,
                 profiles: int = 8):
        if workers < 1 or queue < 0 or timeout <= 0 or cache_size < 0 or profiles < 1:
            raise ValueError(f"planner: need workers >= 1, queue >= 0, timeout > 0, cache_size >= 0, profiles >= 1; got "
                             f"{workers}, {queue}, {timeout}, {cache_size}, {profiles}")
        self.workers, self.queue, self.timeout = workers, queue, timeout
        self.cache_size, self.max_profiles = cache_size, profiles
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agoq-plan")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._pending: dict[tuple, Future] = {}
        self._results: OrderedDict[tuple, dict] = OrderedDict()
        self._profiles: OrderedDict[Path, tuple[tuple, ProfileEntry]] = OrderedDict()
        self._profile_locks: dict[Path, threading.Lock] = {}
        self._mean_seconds = 1.0
        self.solves = 0  # solves run (cache misses), for tests and the load experiment

    # --- profiles -------------------------------------------------------------------------------
    def profile(self, folder: Path) -> ProfileEntry:
        """The entry of a profile folder, loaded again when its files changed; ValueError /
        FileNotFoundError when the search cannot read it."""
        folder = Path(folder)
        with self._lock:
            lock = self._profile_locks.setdefault(folder, threading.Lock())
        with lock:
            signature = folder_signature(folder)
            with self._lock:
                kept = self._profiles.get(folder)
                if kept is not None and kept[0] == signature:
                    self._profiles.move_to_end(folder)
                    return kept[1]
            entry = ProfileEntry(folder)
            with self._lock:
                self._profiles[folder] = (signature, entry)
                self._profiles.move_to_end(folder)
                while len(self._profiles) > self.max_profiles:
                    self._profiles.popitem(last=False)
            return entry

    # --- the pool -------------------------------------------------------------------------------
    def _submit(self, key: tuple, work: Callable[[], dict]) -> Future:
        """The future of `work`, shared with an identical request in flight; Busy when the pool is full."""
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                done: Future = Future()
                done.set_result({**self._results[key], "cached": True})
                return done
            if key in self._pending:
                return self._pending[key]
            if self._in_flight >= self.workers + self.queue:
                waiting = self._in_flight - self.workers + 1
                retry = max(1, math.ceil(waiting * self._mean_seconds / self.workers))
                raise Busy(f"the planner is busy: {self._in_flight} plan(s) are being solved or waiting (at most "
                           f"{self.workers} at a time, {self.queue} waiting); ask again in {retry} s", retry)
            self._in_flight += 1

            def run() -> dict:
                start = time.perf_counter()
                result = work()
                seconds = time.perf_counter() - start
                with self._lock:
                    self.solves += 1
                    self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * seconds
                return {**result, "solve_seconds": seconds, "cached": False}

            future = self._pool.submit(run)
            self._pending[key] = future

        def finished(f: Future) -> None:
            with self._lock:
                self._in_flight -= 1
                self._pending.pop(key, None)
                if not f.cancelled() and f.exception() is None and self.cache_size:
                    self._results[key] = {k: v for k, v in f.result().items() if k != "cached"}
                    while len(self._results) > self.cache_size:
                        self._results.popitem(last=False)

        future.add_done_callback(finished)
        return future

    async def _wait(self, future: Future, what: str) -> dict:
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} took longer than {self.timeout:g} s to solve; it goes on in the background "
                               "and is kept when done: ask again in a while (or start the dashboard with a "
                               "larger --plan-timeout)") from None

    async def plan(self, folder: Path, query: PlanQuery) -> dict[str, Any]:
        """The plan of `query` on the profile in `folder` (see `plan_at_budget`), plus `solve_seconds` and
        `cached`. Raises Busy, TimeoutError, Infeasible, ValueError / FileNotFoundError (unreadable profile)."""
        folder = Path(folder)

        def work() -> dict:
            return plan_at_budget(self.profile(folder), query)

        key = ("plan", folder, folder_signature(folder), query)
        return await self._wait(self._submit(key, work), f"the plan at {format_bytes(query.budget_bytes)}")

    async def budget_range(self, folder: Path) -> dict[str, Any]:
        """The profile's budget range (see ProfileEntry.budget_range), solved in the pool like a plan."""
        folder = Path(folder)
        key = ("range", folder, folder_signature(folder))
        return await self._wait(self._submit(key, lambda: self.profile(folder).budget_range()), "the budget range")

    def status(self) -> dict[str, Any]:
        """Workers, queue length, solves run and results kept."""
        with self._lock:
            return {"workers": self.workers, "queue": self.queue, "in_flight": self._in_flight,
                    "solves": self.solves, "results_kept": len(self._results), "timeout_seconds": self.timeout}

    def close(self) -> None:
        """Stop taking work; running solves finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
