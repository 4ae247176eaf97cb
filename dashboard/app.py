"""The FastAPI application: the read-only JSON API under /api (dashboard.routes_api), the plan service
(dashboard.routes_plan), the HTML pages and static files (dashboard.routes_pages), and the access rules
(token and Host header: dashboard.access; the size of a request body: dashboard.limits). What the routes
share lies on `app.state` (dashboard.state).
Everything reads, except `POST /api/plan/save`, which writes a plan file under ROOT/plans/."""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dashboard import errors, pages, routes_api, routes_pages, routes_plan, routes_whatif
from dashboard.access import Access, guard
from dashboard.errors import http_errors, validation_errors
from dashboard.limits import MAX_BODY_BYTES, BodyLimit
from dashboard.planner import Planner
from dashboard.service import Dashboard

DESCRIPTION = ("Read-only views of agoq's profiles, searches (Pareto fronts, Optuna studies), plans and training "
               "runs found under {root}, and plans solved live at any budget (POST /api/plan; POST /api/plan/save "
               "is the one request that writes, into ROOT/plans/). Artifacts are named by their path relative to "
               "that folder (`id`), as listed by /api/index.")


def create_app(root: str | os.PathLike, token: str | None = None, allowed_hosts: set[str] | None = None,
               ttl: float = 2.0, planner: Planner | None = None) -> FastAPI:
    """The dashboard over `root`. With `token`, every request must carry it (header X-Agoq-Token or
    `Authorization: Bearer`, query parameter ?token=, or the cookie set after a visit with ?token=).
    With `allowed_hosts`, requests whose Host header names another host are refused (against DNS
    rebinding when served without a token on the loopback). `planner` solves the plans of
    POST /api/plan (default: Planner(), two worker threads)."""
    data = Dashboard(root, ttl=ttl)
    app = FastAPI(title="agoq dashboard", version="1", description=DESCRIPTION.format(root=data.catalog.root))
    app.state.dashboard = data
    app.state.planner = planner or Planner()
    app.state.access = Access.of(token, allowed_hosts)

    app.middleware("http")(guard)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)  # outermost: a body over the limit reaches nothing else
    app.add_exception_handler(RequestValidationError, validation_errors)  # in words, not pydantic's list
    app.add_exception_handler(StarletteHTTPException, http_errors)
    app.add_exception_handler(Exception, unexpected)

    app.include_router(routes_api.router)
    app.include_router(routes_plan.router)
    app.include_router(routes_pages.router)
    app.include_router(routes_whatif.router)  # /whatif, /api/whatif
    app.openapi = lambda: errors.document_errors(app, FastAPI.openapi(app))
    return app


async def unexpected(request: Request, exc: Exception) -> Response:
    """500 saying what failed: JSON under /api/, an HTML error page elsewhere."""
    text = f"unexpected error: {type(exc).__name__}: {exc}"
    if request.url.path.startswith("/api/"):
        return JSONResponse({"detail": text}, status_code=500)
    return HTMLResponse(pages.error_page("error", text), status_code=500)
