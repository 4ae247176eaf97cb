"""Who may reach the dashboard and who may write through it.

- Who counts as this machine: the addresses the dashboard may serve without a token (LOOPBACK_NAMES,
  is_loopback), and the clients that may write (save a plan) when it has none.
- `guard`, the HTTP middleware every request passes: with `allowed_hosts`, a Host header naming another host is
  refused (against DNS rebinding when served without a token on the loopback); with a `token`, every request
  must carry it (header X-Agoq-Token or `Authorization: Bearer`, query parameter ?token=, or the cookie set
  after a visit with ?token=, which also sends a page's address on without the token); every answer but the
  API documentation's gets PAGE_SECURITY's headers.
- `check_write`: a request that writes (POST /api/plan/save) must be a JSON body from this dashboard's own
  pages, and, when the dashboard has no token, come from this machine.
The settings of one app (`Access`) lie on its state as `app.state.access`."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable
from urllib.parse import urlencode

from fastapi import HTTPException, Request, Response
from fastapi.responses import PlainTextResponse, RedirectResponse

from dashboard.hosts import LOOPBACK_NAMES, is_loopback

TOKEN_COOKIE = "agoq_dashboard_token"
TOKEN_HEADER = "x-agoq-token"
PAGE_SECURITY = {"content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                            "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'",
                 "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


@dataclass(frozen=True)
class Access:
    """The access settings of one dashboard: the `token` every request must carry (None: none asked), and the
    names a request's Host header may give (`allowed_hosts`, lower case; None: any)."""

    token: str | None = None
    allowed_hosts: frozenset[str] | None = None

    @classmethod
    def of(cls, token: str | None, allowed_hosts: Iterable[str] | None) -> "Access":
        """The settings of create_app's arguments of those names."""
        return cls(token, None if allowed_hosts is None else frozenset(allowed_hosts))


def _given_token(request: Request) -> tuple[str | None, bool]:
    """The token a request carries (header, bearer, query or cookie) and whether it came in the query."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip(), False
    if request.headers.get(TOKEN_HEADER):
        return request.headers[TOKEN_HEADER], False
    if request.query_params.get("token"):
        return request.query_params["token"], True
    return request.cookies.get(TOKEN_COOKIE), False


def _host(request: Request) -> str:
    """The host a request's Host header names, lower case, without its port (nor an IPv6 address's brackets)."""
    host = (request.headers.get("host") or "").lower()
    return host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]


async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """HTTP middleware: the access rules of `request.app.state.access` (see the module's docstring)."""
    rules: Access = request.app.state.access
    host = _host(request)
    if rules.allowed_hosts is not None and host not in rules.allowed_hosts:
        return PlainTextResponse(f"Host {host!r} is not served here: without a token this dashboard only "
                                 "answers to localhost addresses (start it with --token to reach it "
                                 "under another name, e.g. through a proxy)", status_code=400)
    from_query = False
    if rules.token is not None:
        given, from_query = _given_token(request)
        if not given or not hmac.compare_digest(given.encode(), rules.token.encode()):
            return PlainTextResponse("this dashboard needs its token: add ?token=... to the address "
                                     f"(or send the header {TOKEN_HEADER})", status_code=401)
    if from_query and request.method == "GET" and not request.url.path.startswith("/api/"):
        # keep the token out of the address bar, history and shared links: a cookie carries it
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        response = RedirectResponse(request.url.path + ("?" + urlencode(rest) if rest else ""), status_code=303)
    else:
        response = await call_next(request)
    if from_query:
        response.set_cookie(TOKEN_COOKIE, rules.token, httponly=True, samesite="strict")
    if not request.url.path.startswith(("/docs", "/redoc")):
        response.headers.update(PAGE_SECURITY)
    return response


def check_write(request: Request) -> None:
    """Refuse a write a page of another site could have sent (415: not a JSON body; 403: an Origin, when the
    browser sends one, naming another host than this dashboard's), and, when the dashboard has no token, a
    write from another machine (403)."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, "send the request as JSON (Content-Type: application/json)")
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://", 1)[-1].lower() != (request.headers.get("host") or "").lower():
        raise HTTPException(403, f"a request from {origin} may not save plans here: open the dashboard itself")
    client = request.client.host if request.client else ""
    if request.app.state.access.token is None and not is_loopback(client):
        raise HTTPException(403, "saving plans from another machine needs the dashboard's token: start it with "
                                 "--token (or AGOQ_DASHBOARD_TOKEN) and send it")
