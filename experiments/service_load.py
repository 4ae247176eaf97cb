"""Load on the dashboard's live planner: N concurrent `POST /api/plan` over loopback against a real uvicorn
server (in a thread of this process), each for one of K budgets spread over the profile's range. A 503 is
retried after its Retry-After; every request must end in a 200 whose plan fits its budget and equals the
other answers at that budget, before a deadline; the server must answer afterwards. Reports latency (p50,
p95, max, seconds from first send to final answer, retries included), 503s seen and solves run.

    python experiments/service_load.py --root DIR --profile ID [--requests 50] [--budgets 12]
    python experiments/service_load.py --synthetic [--model llama-tiny]     # a made-up profile in a temp dir

Writes experiments/results/service_load.json (experiments/record.py) unless --no-record.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@contextlib.contextmanager
def serve(app, start_timeout: float = 30.0) -> Iterator[tuple[str, int]]:
    """Run `app` under uvicorn on a free loopback port in a daemon thread; yields (host, port), stops after."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def request(host: str, port: int, method: str, path: str, body: Any = None, timeout: float = 60.0):
    """(status, headers, parsed JSON body) of one request on its own connection."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body)
        conn.request(method, path, body=payload, headers={"content-type": "application/json"} if body else {})
        r = conn.getresponse()
        raw = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw) if raw else None
    finally:
        conn.close()


def run_load(host: str, port: int, profile: str, budgets: list[int], requests: int, deadline_s: float = 50.0,
             max_attempts: int = 60) -> dict[str, Any]:
    """Send `requests` plan requests at once (request i asks for budgets[i % len]); returns the figures and
    `failures` (every answer that was not a 200 with a plan within its budget, or a well-formed 503)."""
    stop_at = time.monotonic() + deadline_s
    failures: list[str] = []
    answers: dict[int, list[dict]] = {}
    lock = threading.Lock()
    start = threading.Barrier(requests)

    def one(i: int) -> dict[str, Any]:
        budget = budgets[i % len(budgets)]
        start.wait()
        t0 = time.perf_counter()
        retries = 0
        for _ in range(max_attempts):
            status, headers, body = request(host, port, "POST", "/api/plan", {"profile": profile, "budget": budget})
            if status == 200:
                peak = body["predicted"]["peak_bytes"]
                if body["budget_bytes"] != budget or peak > budget:
                    with lock:
                        failures.append(f"budget {budget}: answered budget {body['budget_bytes']}, peak {peak}")
                with lock:
                    answers.setdefault(budget, []).append(body["plan"])
                return {"seconds": time.perf_counter() - t0, "retries": retries, "cached": body["cached"]}
            if status == 503 and "retry-after" in headers and isinstance(body, dict) and "busy" in str(body.get("detail")):
                retries += 1
                wait = float(headers["retry-after"])
                if time.monotonic() + wait > stop_at:
                    break
                time.sleep(wait)
                continue
            with lock:
                failures.append(f"budget {budget}: HTTP {status} {body}")
            return {"seconds": time.perf_counter() - t0, "retries": retries, "cached": None}
        with lock:
            failures.append(f"budget {budget}: no plan before the deadline after {retries} 503s")
        return {"seconds": time.perf_counter() - t0, "retries": retries, "cached": None}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    for budget, plans in answers.items():
        first = {k: v for k, v in plans[0].items() if k != "source"}
        if any({k: v for k, v in p.items() if k != "source"} != first for p in plans[1:]):
            failures.append(f"budget {budget}: different plans for the same budget")
    seconds = sorted(r["seconds"] for r in results)
    status, _, _ = request(host, port, "GET", "/api/index")
    if status != 200:
        failures.append(f"the server answered {status} to /api/index after the load")
    return {"requests": requests, "budgets": len(budgets), "answered_200": sum(len(v) for v in answers.values()),
            "retried_503": sum(r["retries"] for r in results),
            "requests_that_waited": sum(1 for r in results if r["retries"]),
            "cached_answers": sum(1 for r in results if r["cached"]),
            "latency_seconds": {"p50": statistics.median(seconds), "p95": seconds[max(0, math.ceil(0.95 * len(seconds)) - 1)],
                                "max": seconds[-1]},
            "wall_seconds": wall, "server_up_after": status == 200, "failures": failures}


def spread(low: int, high: int, count: int) -> list[int]:
    """`count` budgets (bytes) spread over [low, high], not round numbers."""
    return [int(low + (high - low) * (i + 0.37) / count) + 7 * i for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="the dashboard's root folder")
    parser.add_argument("--profile", help="a profile id under --root (as /api/index lists it)")
    parser.add_argument("--synthetic", action="store_true", help="make a profile with random figures in a temp dir")
    parser.add_argument("--model", default="llama-tiny", help="model of the --synthetic profile (default llama-tiny)")
    parser.add_argument("--requests", type=int, default=50, help="concurrent requests (default 50)")
    parser.add_argument("--budgets", type=int, default=12, help="distinct budgets among them (default 12)")
    parser.add_argument("--workers", type=int, default=2, help="planner worker threads (default 2)")
    parser.add_argument("--queue", type=int, default=8, help="planner queue beyond the workers (default 8)")
    parser.add_argument("--deadline", type=float, default=50.0, help="seconds before giving up (default 50)")
    parser.add_argument("--no-record", action="store_true", help="print only, write no result file")
    args = parser.parse_args(argv)
    if args.synthetic == bool(args.root):
        parser.error("give --root and --profile, or --synthetic")
    import os

    from dashboard.app import create_app
    from dashboard.planner import Planner

    with tempfile.TemporaryDirectory() as tmp:
        root, profile = (args.root, args.profile)
        if args.synthetic:
            import random

            from tests.search.synthetic_profile import write_profile

            root, profile = tmp, "profile"
            write_profile(Path(tmp) / profile, random.Random(7), model=args.model, micro_batch=3, seq_len=37)
        planner = Planner(workers=args.workers, queue=args.queue)
        app = create_app(root, planner=planner)
        with serve(app) as (host, port):
            status, _, found = request(host, port, "GET", f"/api/plan/range?profile={profile}")
            if status != 200 or "error" in found:
                raise SystemExit(f"no budget range for {profile}: {status} {found}")
            budgets = spread(found["smallest_budget_bytes"], found["largest_budget_bytes"], args.budgets)
            figures = run_load(host, port, profile, budgets, args.requests, args.deadline)
        figures.update({"profile": "synthetic " + args.model if args.synthetic else profile,
                        "workers": args.workers, "queue": args.queue, "solves": planner.solves,
                        "machine": "CPU (the planner solves on the CPU)", "cpu_count": os.cpu_count(),
                        "load_average_1_5_15min_at_end": list(os.getloadavg())})
        planner.close()
    print(json.dumps(figures, indent=2))
    if not args.no_record:
        from experiments.record import write_result

        print(f"wrote {write_result('service_load', figures)}")
    return 0 if not figures["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
