"""The FastAPI application: JSON API under /api, HTML pages, static files (Plotly's bundle from the
installed plotly package, so the pages work offline), and the access rules (token, Host header)."""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
)

from dashboard import pages
from dashboard.formats import BrokenFile
from dashboard.service import MAX_POINTS_LIMIT, Dashboard

STATIC = Path(__file__).with_name("static")
TOKEN_COOKIE = "agoq_dashboard_token"
TOKEN_HEADER = "x-agoq-token"
MAX_COMPARE = 12
PAGE_SECURITY = {"content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                            "img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'",
                 "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


def plotly_bundle() -> Path:
    """plotly.min.js as shipped inside the installed plotly package."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall plotly (pip install --force-reinstall plotly)")
    return path


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


def create_app(root: str | os.PathLike, token: str | None = None, allowed_hosts: set[str] | None = None,
               ttl: float = 2.0) -> FastAPI:
    """The dashboard over `root`. With `token`, every request must carry it (header X-Agoq-Token or
    `Authorization: Bearer`, query parameter ?token=, or the cookie set after a visit with ?token=).
    With `allowed_hosts`, requests whose Host header names another host are refused (against DNS
    rebinding when served without a token on the loopback)."""
    data = Dashboard(root, ttl=ttl)
    app = FastAPI(title="agoq dashboard", version="1",
                  description="Read-only views of agoq's profiles, searches (Pareto fronts, Optuna studies), plans "
                              f"and training runs found under {data.catalog.root}. Artifacts are named by their "
                              "path relative to that folder (`id`), as listed by /api/index.")
    app.state.dashboard = data

    @app.middleware("http")
    async def access(request: Request, call_next):
        if allowed_hosts is not None:
            host = (request.headers.get("host") or "").lower()
            host = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
            if host not in allowed_hosts:
                return PlainTextResponse(f"Host {host!r} is not served here: without a token this dashboard only "
                                         "answers to localhost addresses (start it with --token to reach it "
                                         "under another name, e.g. through a proxy)", status_code=400)
        from_query = False
        if token is not None:
            given, from_query = _given_token(request)
            if not given or not hmac.compare_digest(given.encode(), token.encode()):
                return PlainTextResponse("this dashboard needs its token: add ?token=... to the address "
                                         f"(or send the header {TOKEN_HEADER})", status_code=401)
        if from_query and request.method == "GET" and not request.url.path.startswith("/api/"):
            # keep the token out of the address bar, history and shared links: a cookie carries it
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            response = RedirectResponse(request.url.path + ("?" + urlencode(rest) if rest else ""), status_code=303)
        else:
            response = await call_next(request)
        if from_query:
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        if not request.url.path.startswith(("/docs", "/redoc")):
            response.headers.update(PAGE_SECURITY)
        return response

    def api(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except KeyError as e:
            raise HTTPException(404, f"not found under the root: {e.args[0] if e.args else e}") from None
        except (BrokenFile, ValueError) as e:
            raise HTTPException(422, str(e)) from None

    def page(title: str, fn: Callable[[], str]) -> HTMLResponse:
        try:
            return HTMLResponse(fn())
        except KeyError as e:
            return HTMLResponse(pages.error_page(title, f"nothing named {e.args[0] if e.args else e} "
                                                        "under the root (see the overview)"), status_code=404)
        except (BrokenFile, ValueError) as e:
            return HTMLResponse(pages.error_page(title, str(e)), status_code=422)

    # --- JSON API -------------------------------------------------------------------------------
    @app.get("/api/index", tags=["api"], summary="Everything found under the root, with key figures",
             description="`profiles`, `searches`, `plans`, `runs`: lists of {id, key figures...} or {id, error}; "
                         "`problems`: paths skipped (e.g. symlinks leading outside the root); `scanned_at`: epoch s.")
    def api_index(refresh: bool = Query(False, description="rescan now instead of within the cache time")):
        return data.overview(refresh=refresh)

    @app.get("/api/profile", tags=["api"], summary="A profile: key figures, heat maps, error curves, collectives",
             description="`maps`: layers x kinds grids of `sensitivity` (relative L2 of all weight gradients), "
                         "`bytes` (kept per micro-batch) and `quant_error` at `option`; `curves`: per kind and format, "
                         "mean errors against bits; `times`: per kind, the mean seconds each option adds (quantize + dequantize per "
                         "bit width, recompute); `collectives`: seconds against message bytes per (op, path). "
                         "A part that cannot be read is {error}.")
    def api_profile(id: str = Query(..., description="profile folder, relative to the root"),
                    option: str | None = Query(None, description='option of the heat maps ("4", "recompute"...)')):
        return api(lambda: data.profile(id, option))

    @app.get("/api/search", tags=["api"], summary="A search: Pareto front, chosen plan, Optuna studies",
             description="`pareto`: pareto.csv rows (numbers parsed; `validated`, `plan_id`); `chosen_plan`: as "
                         "/api/plan; `study`: {file, studies: [{name, directions, objectives, states, trials}]}.")
    def api_search(id: str = Query(..., description="search folder, relative to the root")):
        return api(lambda: data.search(id))

    @app.get("/api/plan", tags=["api"], summary="A plan: key figures, bit widths, memory breakdown",
             description="`bits`: layers x kinds (16, 2..8, 0 = recompute, -1 = layer checkpointed); `memory`: per "
                         "stage, predicted parts (weights, gradients, optimizer, activations, other; bytes) and "
                         "measured peaks; `runs`: runs that trained with this plan.")
    def api_plan(id: str = Query(..., description="plan file, relative to the root")):
        return api(lambda: data.plan(id))

    @app.get("/api/run", tags=["api"], summary="A run: key figures and settings")
    def api_run(id: str = Query(..., description="run folder, relative to the root")):
        return api(lambda: data.run(id))

    @app.get("/api/curves", tags=["api"],
             summary="Runs' curves (loss, val loss, tokens/s, peak bytes per rank), thinned to `points` each",
             description="Per run: `series.{loss, val_loss, tokens_per_s, grad_norm, step_seconds, lr}` = {step, "
                         "value, elapsed_s} and `peak_bytes` = [{rank, step, value, elapsed_s}]; `train_points` and "
                         "`val_points` count the lines before thinning (lowest and highest point per bucket).")
    def api_curves(id: list[str] = Query(..., description="run folder(s), relative to the root"),
                   points: int = Query(2000, ge=4, le=MAX_POINTS_LIMIT,
                                       description="most points per curve (min and max per bucket are kept)")):
        if len(id) > MAX_COMPARE:
            raise HTTPException(422, f"at most {MAX_COMPARE} runs at once")
        return {"runs": [api(lambda i=i: data.curves(i, points)) for i in id]}

    # --- pages ----------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def overview_page(refresh: bool = False):
        return page("overview", lambda: pages.overview(data.overview(refresh=refresh)))

    @app.get("/profile", response_class=HTMLResponse, include_in_schema=False)
    def profile_page(id: str, option: str | None = None):
        return page("profile", lambda: pages.profile(data.profile(id, option)))

    @app.get("/search", response_class=HTMLResponse, include_in_schema=False)
    def search_page(id: str):
        return page("search", lambda: pages.search(data.search(id)))

    @app.get("/plan", response_class=HTMLResponse, include_in_schema=False)
    def plan_page(id: str):
        return page("plan", lambda: pages.plan(data.plan(id)))

    @app.get("/runs", response_class=HTMLResponse, include_in_schema=False)
    def runs_page(id: list[str] = Query([]), points: int = Query(2000, ge=4, le=MAX_POINTS_LIMIT),
                  x: str = Query("step", pattern="^(step|time)$")):
        def build() -> str:
            everything = data.overview()["runs"]
            selected = list(dict.fromkeys(id))[:MAX_COMPARE]
            if not id:
                newest = sorted((r for r in everything if "error" not in r),
                                key=lambda r: str(r.get("updated") or ""), reverse=True)
                selected = [r["id"] for r in newest[:6]]
            chosen, errors = [], []
            for run_id in selected:
                try:
                    chosen.append(data.curves(run_id, points))
                except KeyError:
                    errors.append(f"no run named {run_id} under the root")
                except BrokenFile as e:
                    errors.append(f"{run_id}: {e}")
            return pages.runs(everything, chosen, selected, errors, x)
        return page("runs", build)

    # --- static files ---------------------------------------------------------------------------
    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly_js():
        return FileResponse(plotly_bundle(), media_type="text/javascript",
                            headers={"cache-control": "max-age=86400"})

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str):
        files = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
        if name not in files:
            raise HTTPException(404, "no such file")
        return FileResponse(STATIC / name, media_type=files[name])

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon():
        return PlainTextResponse("", status_code=204)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        text = f"unexpected error: {type(exc).__name__}: {exc}"
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": text}, status_code=500)
        return HTMLResponse(pages.error_page("error", text), status_code=500)

    return app
