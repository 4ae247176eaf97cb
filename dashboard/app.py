"""The FastAPI application: JSON API under /api, HTML pages, static files (Plotly's bundle from the
installed plotly package, so the pages work offline), and the access rules (token, Host header, the size of a
request body: dashboard.limits).
Everything reads, except `POST /api/plan/save`, which writes a plan file under ROOT/plans/."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
)

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from agoq.search.request import CAP_FIELDS, BadField, InfeasibleBudget, SearchRequest, cap_defaults
from agoq.units import excerpt
from dashboard import pages, saved_plans
from dashboard.access import Access, check_write, guard
from dashboard.formats import BrokenFile
from dashboard.limits import MAX_BODY_BYTES, BodyLimit, clipped, short_validation_errors
from dashboard.planner import Busy, Planner, service_request
from dashboard.profiles import table_file
from dashboard.service import MAX_POINTS_LIMIT, Dashboard

STATIC = Path(__file__).with_name("static")
MAX_COMPARE = 12


def plotly_bundle() -> Path:
    """plotly.min.js as shipped inside the installed plotly package."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall plotly (pip install --force-reinstall plotly)")
    return path


class PlanRequest(BaseModel):
    """A plan at one budget: the profile, and the budget and caps of its search request (agoq.search.request),
    read by the rules that read `agoq search`'s flags."""

    model_config = ConfigDict(extra="forbid")
    profile: str = Field(..., description="profile folder, relative to the root (as /api/profile's id)")
    budget: StrictInt | StrictFloat | StrictStr = Field(..., description='memory per GPU (each pipeline stage): bytes, or a size '
                                                       'as `agoq search --budget` reads it ("30GiB", "4GB")')
    objective: StrictStr | None = Field(None, description="what the plan minimises, as `agoq search --objective` "
                                                    "(omitted or null: the command's default)")
    time_cap: StrictInt | StrictFloat | StrictStr | None = Field(None, description='seconds per step, "checkpoint" or "none", as '
                                                           "`agoq search --time-cap` (omitted or null: its default)")
    error_cap: StrictInt | StrictFloat | StrictStr | None = Field(None, description='a gradient error, "recipe" or "none", as '
                                                            "`agoq search --error-cap` (omitted or null: its default)")

    def request(self) -> SearchRequest:
        """The search request of these fields (null or omitted: the default); BadField naming the field refused."""
        return service_request({name: getattr(self, name) for name in ("budget", *CAP_FIELDS)})


class SaveRequest(PlanRequest):
    """A plan at one budget saved as ROOT/plans/NAME."""

    name: StrictStr = Field(..., description="file name (letters, digits, '.', '_', '-'; .json added when missing)")
    overwrite: StrictBool = Field(False, description="replace a file of that name (otherwise 409)")


def create_app(root: str | os.PathLike, token: str | None = None, allowed_hosts: set[str] | None = None,
               ttl: float = 2.0, planner: Planner | None = None) -> FastAPI:
    """The dashboard over `root`. With `token`, every request must carry it (header X-Agoq-Token or
    `Authorization: Bearer`, query parameter ?token=, or the cookie set after a visit with ?token=).
    With `allowed_hosts`, requests whose Host header names another host are refused (against DNS
    rebinding when served without a token on the loopback). `planner` solves the plans of
    POST /api/plan (default: Planner(), two worker threads)."""
    data = Dashboard(root, ttl=ttl)
    planner = planner or Planner()
    app = FastAPI(title="agoq dashboard", version="1",
                  description="Read-only views of agoq's profiles, searches (Pareto fronts, Optuna studies), plans "
                              f"and training runs found under {data.catalog.root}, and plans solved live at any "
                              "budget (POST /api/plan; POST /api/plan/save is the one request that writes, into "
                              "ROOT/plans/). Artifacts are named by their path relative to that folder (`id`), as "
                              "listed by /api/index.")
    app.state.dashboard = data
    app.state.planner = planner

    app.state.access = Access.of(token, allowed_hosts)
    app.middleware("http")(guard)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)  # outermost: a body over the limit reaches nothing else
    app.add_exception_handler(RequestValidationError, short_validation_errors)

    def api(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except KeyError as e:
            raise HTTPException(404, f"not found under the root: {clipped(e.args[0] if e.args else e)}") from None
        except (BrokenFile, ValueError) as e:
            raise HTTPException(422, str(e)) from None

    def page(title: str, fn: Callable[[], str]) -> HTMLResponse:
        try:
            return HTMLResponse(fn())
        except KeyError as e:
            return HTMLResponse(pages.error_page(title, f"nothing named {clipped(e.args[0] if e.args else e)} "
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
                         "stage, the parts of the predicted peak the plan records (bytes on one rank at the phase "
                         "that sets the peak, `phases`; they add up to the peak; none for plans before schema 1.2) "
                         "and measured peaks; `runs`: runs that trained with this plan.")
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

    # --- live plans -----------------------------------------------------------------------------
    def profile_folder(profile_id: str) -> Path:
        """The folder of a profile the search may read: every file it reads lies inside the root."""
        try:
            folder = data.catalog.folder(data.catalog.get("profiles", profile_id))
            folder.file("profile.json")
            table_file(folder, "table")
            table_file(folder, "collectives")
        except KeyError:
            shown = excerpt(profile_id)
            raise HTTPException(404, f"no profile named {shown} under the root (see /api/index)") from None
        except BrokenFile as e:
            raise HTTPException(422, f"profile {profile_id}: {e}") from None
        return folder.path

    async def solved(fn: Callable[[], Any]) -> Any:
        """await fn() with the planner's failures as HTTP answers."""
        try:
            return await fn()
        except Busy as e:
            raise HTTPException(503, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        except TimeoutError as e:
            raise HTTPException(504, str(e)) from None
        except InfeasibleBudget as e:
            raise HTTPException(422, {"message": e.advice(), "smallest_budget_bytes": e.smallest_budget}) from None
        except (ValueError, FileNotFoundError, BrokenFile) as e:
            raise HTTPException(422, str(e)) from None

    def read_request(body: PlanRequest) -> SearchRequest:
        try:
            return body.request()
        except BadField as e:
            raise HTTPException(422, str(e)) from None

    async def plan_for(body: PlanRequest) -> dict[str, Any]:
        request = read_request(body)
        folder = await run_in_threadpool(profile_folder, body.profile)
        result = await solved(lambda: planner.plan(folder, request))
        return {"profile": body.profile, "budget_bytes": request.budget, "caps": request.caps, **result}

    @app.post("/api/plan", tags=["api"], summary="Solve a plan at a budget, as `agoq search` would",
              description="The plan `agoq search --profile P --budget B` writes (with the objective and caps "
                          "given, else the command's defaults), solved by the same search in a pool of worker "
                          "threads. Answers {profile, budget_bytes, caps, plan, predicted: {peak_bytes, "
                          "peak_bytes_per_stage, step_seconds, tokens_per_step, tokens_per_second, grad_error}, "
                          "alternative (the best alternative the search priced, or null), notes, view: {summary, "
                          "bits, memory, figures} (as /api/plan?id= shows a plan), solve_seconds, cached}. "
                          "404: unknown profile; 422: bad budget or caps, a profile the search cannot read, or a "
                          "budget nothing fits (detail.smallest_budget_bytes says what does); 413: a body over "
                          f"{MAX_BODY_BYTES} bytes; 503 with "
                          "Retry-After: every worker busy and the queue full; 504: the solve outlasted the "
                          "timeout (it finishes in the background and is kept).")
    async def api_plan_solve(body: PlanRequest):
        result = await plan_for(body)
        result["view"] = await run_in_threadpool(data.plan_view, result["plan"])
        return result

    @app.get("/api/plan/range", tags=["api"], summary="The budgets worth asking a profile's plan about",
             description="{profile, smallest_budget_bytes (the least any plan fits, no caps), largest_budget_bytes "
                         "(the peak of the plan that keeps everything), defaults: `agoq search`'s objective and caps, "
                         "objectives}; a profile the search cannot read answers {profile, error} so that its page "
                         "can say why.")
    async def api_plan_range(profile: str = Query(..., description="profile folder, relative to the root")):
        folder = await run_in_threadpool(profile_folder, profile)
        try:
            found = await solved(lambda: planner.budget_range(folder))
        except HTTPException as e:
            if e.status_code != 422:
                raise
            return {"profile": profile, "error": str(e.detail)}
        return {"profile": profile, **found, "defaults": cap_defaults()}

    @app.post("/api/plan/save", tags=["api"], summary="Save the plan at a budget as ROOT/plans/NAME",
              description="Solves (or takes from the cache) the plan POST /api/plan gives for the same fields and "
                          "writes it, as `agoq search` writes a plan, to ROOT/plans/NAME atomically. 409 when the "
                          "file exists and `overwrite` is false; 403 from another machine unless the dashboard "
                          "has a token; 415 unless the body is JSON. Answers {id, path, overwritten}.")
    async def api_plan_save(body: SaveRequest, request: Request):
        check_write(request)
        try:
            name = saved_plans.safe_name(body.name)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        result = await plan_for(body)
        existed = (data.catalog.root / saved_plans.FOLDER / name).exists()

        def write() -> Path:
            return saved_plans.save_plan(data.catalog.root, name, result["plan"], overwrite=body.overwrite)

        try:
            path = await run_in_threadpool(write)
        except saved_plans.Exists as e:
            raise HTTPException(409, str(e)) from None
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        data.catalog.outdated()
        return {"id": f"{saved_plans.FOLDER}/{name}", "path": str(path), "overwritten": bool(body.overwrite and existed)}

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
        files = {"dashboard.js": "text/javascript", "planner.js": "text/javascript", "dashboard.css": "text/css"}
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
