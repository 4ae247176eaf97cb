"""The live policy search behind `POST /api/plan`: one plan per (profile, search request), solved by the
same call `agoq search` makes, in a bounded pool of worker threads so no solve blocks the server.

- A request is a SearchRequest (agoq.search.request), read from the JSON fields by the same rules that read
  `agoq search`'s flags (budget sizes such as "4GB", the caps' words "checkpoint" / "recipe" / "none"), so
  that both accept the same values with the same defaults. The service only fixes what serves one budget
  (SERVICE_FIXED): the MILP at the asked budget, no Pareto front, no validation runs.
- Threads, not processes: scipy's HiGHS releases the GIL while it solves, so two solves in two threads
  take about the time of one and the event loop keeps answering meanwhile (measured on a 2-core CPU:
  six 24-layer solves 6.4 s in a row, 3.4 s on two threads, 15 s on two spawned processes).
- A solve that is running cannot be stopped: a request that waits longer than the timeout is told so
  (TimeoutError -> 504) while the solve goes on and its result is kept for the next ask. Identical
  requests in flight share one solve.
- Warm start: per profile folder (keyed by its path and its files' modification times and sizes) the
  checked profile, the built choice problem and its budget range are kept; results are kept in an LRU
  keyed by (profile, its files, request).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from agoq.parallel_dims import plan_dims
from agoq.search.request import SearchRequest
from agoq.units import format_bytes

# what the service itself decides, whatever `agoq search` would do: one MILP plan at the asked budget
SERVICE_FIXED = {"method": "milp", "front_budgets": 0, "validate": 0, "measure_trials": False}


class Busy(Exception):
    """Every worker is solving and the queue is full; `retry_after` is seconds worth waiting."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def service_request(fields: Mapping[str, Any]) -> SearchRequest:
    """The search request of a plan request's fields (named as SearchRequest.read names them; None, JSON's
    null, as if omitted: the default), with what the service fixes (SERVICE_FIXED); BadField naming the field
    refused."""
    given = {name: value for name, value in fields.items() if value is not None}
    return SearchRequest.read({**given, **SERVICE_FIXED})


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


def tokens_per_step(plan: dict[str, Any]) -> int:
    """Tokens one optimizer step of the plan trains on: micro-batch x sequence x accumulation x data ranks (the
    plan's dims, agoq.parallel_dims: replicate x shard, whatever shards; a pipeline's stages read one batch)."""
    training = plan.get("training") or {}
    dims = plan_dims(plan)
    ranks = 1 if dims is None else dims.data_ranks
    return int(training.get("micro_batch", 1)) * int(training.get("seq_len", 1)) * \
        int(training.get("grad_accum", 1)) * ranks


def plan_at_budget(entry: ProfileEntry, request: SearchRequest) -> dict[str, Any]:
    """The plan `agoq search` writes for `request` on the entry's profile, with its predicted figures:
    {plan, predicted: {peak_bytes, peak_bytes_per_stage, step_seconds, tokens_per_step, tokens_per_second,
    grad_error}, alternative, notes}. InfeasibleBudget when no plan fits the budget under the caps."""
    from agoq.search.search import search

    outcome = search(entry.profile, request, progress=False)
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

    async def plan(self, folder: Path, request: SearchRequest) -> dict[str, Any]:
        """The plan of `request` on the profile in `folder` (see `plan_at_budget`), plus `solve_seconds` and
        `cached`. Raises Busy, TimeoutError, InfeasibleBudget, ValueError / FileNotFoundError (unreadable
        profile)."""
        folder = Path(folder)

        def work() -> dict:
            return plan_at_budget(self.profile(folder), request)

        key = ("plan", folder, folder_signature(folder), request)
        return await self._wait(self._submit(key, work), f"the plan at {format_bytes(request.budget)}")

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
