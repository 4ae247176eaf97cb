"""Serve a web page over agoq's outputs: the profiles, searches (Pareto fronts, Optuna studies), plans
and training runs found under --root, rescanned as new ones appear.

Pages: / (overview), /profile, /search, /plan, /runs (pick runs to compare); the JSON API is under
/api/ and documented at /docs (OpenAPI at /openapi.json). POST /api/plan solves a profile's plan at any
budget as `agoq search` would (the profile page's budget slider), in --plan-workers threads with at most
--plan-queue requests waiting. The dashboard only reads, except that the profile page's "save plan"
(POST /api/plan/save) writes the plan shown to --root/plans/NAME.json; no request reaches a file outside
--root.

It listens on 127.0.0.1 unless told otherwise; listening on any other address needs a token (--token
or the environment variable AGOQ_DASHBOARD_TOKEN), which every request must then carry: open
http://HOST:PORT/?token=TOKEN once (a cookie keeps it), or send the header X-Agoq-Token.

example:
  agoq dashboard --root runs/demo
  AGOQ_DASHBOARD_TOKEN=$(openssl rand -hex 16) agoq dashboard --root /data/agoq --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from dashboard.hosts import LOOPBACK_NAMES, is_loopback

HELP = "serve a web page of profiles, plans, searches and runs"
TOKEN_ENV = "AGOQ_DASHBOARD_TOKEN"


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `agoq dashboard`."""
    from agoq.commands.arguments import non_negative_int, positive_float, positive_int

    parser.add_argument("--root", required=True,
                        help="folder to look in (searched recursively, up to 8 levels; e.g. the folder `agoq demo` wrote)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; any other needs a token)")
    parser.add_argument("--port", type=positive_int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--token", default=None,
                        help=f"access token every request must carry (default: ${TOKEN_ENV}, better than the "
                             "flag, which other users can see in the process list; required when --host is not "
                             "a loopback address)")
    parser.add_argument("--rescan-seconds", type=float, default=2.0,
                        help="how long a scan of --root is reused before a request rescans it (default 2 s)")
    parser.add_argument("--plan-workers", type=positive_int, default=2,
                        help="plans solved at a time for POST /api/plan, one thread each (default 2)")
    parser.add_argument("--plan-queue", type=non_negative_int, default=16,
                        help="plan requests waiting beyond those being solved; more are answered 503 (default 16)")
    parser.add_argument("--plan-timeout", type=positive_float, default=30.0,
                        help="seconds a plan request waits for its solve before a 504 (default 30)")
    parser.set_defaults(func=run)


def _check_port_free(host: str, port: int) -> None:
    """ValueError naming the port when something already listens there (before saying "serving")."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}): another program (an earlier "
                             "dashboard?) uses it; pass --port with another number") from None


def run(args: argparse.Namespace) -> int:
    """Check the arguments, build the app and serve it until interrupted."""
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if not is_loopback(args.host) and not token:
        raise ValueError(f"--host {args.host} accepts connections from other machines, so it needs a token: "
                         f"pass --token (or set {TOKEN_ENV}), e.g. --token {secrets.token_hex(16)}")
    if token is not None and len(token) < 8:
        raise ValueError("--token is too short: use at least 8 characters (e.g. `openssl rand -hex 16`)")
    if args.port > 65535:
        raise ValueError(f"--port {args.port}: a TCP port is at most 65535")
    if args.rescan_seconds < 0:
        raise ValueError("--rescan-seconds must be >= 0")
    import uvicorn

    from dashboard.app import create_app
    from dashboard.planner import Planner

    allowed = None if token else LOOPBACK_NAMES | {args.host.lower()}
    planner = Planner(workers=args.plan_workers, queue=args.plan_queue, timeout=args.plan_timeout)
    app = create_app(args.root, token=token, allowed_hosts=allowed, ttl=args.rescan_seconds, planner=planner)
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    address = f"http://{shown_host}:{args.port}/" + (f"?token={token}" if token else "")
    _check_port_free(args.host, args.port)
    print(f"agoq dashboard: serving {app.state.dashboard.catalog.root} at {address}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
