"""The plan service: POST /api/plan solves a profile's plan at a budget as `agoq search` would, GET
/api/plan/range says which budgets are worth asking about, POST /api/plan/save writes a plan into ROOT/plans/
(the one request that writes). The solves run in the app's planner (app.state.planner, dashboard.planner);
its failures answer as HTTP errors (503 busy, 504 timed out, 422 a budget nothing fits or a bad field)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from agoq.formats.views import FormatError
from agoq.search.request import CAP_FIELDS, BadField, InfeasibleBudget, SearchRequest, cap_defaults
from agoq.units import excerpt
from dashboard import saved_plans
from dashboard.access import check_write
from dashboard.limits import MAX_BODY_BYTES
from dashboard.planner import Busy, Planner, service_request
from dashboard.profiles import table_file
from dashboard.service import Dashboard
from dashboard.state import DashboardState, PlannerState

router = APIRouter(prefix="/api", tags=["api"])
KNOB_FIELDS = ("layout", "gradients")  # the knob space's words a plan request may fix, as `agoq search`'s flags


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
    layout: StrictStr | None = Field(None, description='"replicated", "fsdp", "hsdp" (where the ranks span nodes) '
                                                       'or "any", as `agoq search --layout` (omitted or null: any)')
    gradients: StrictStr | None = Field(None, description='"bf16", "quangrad8", "sdp4bit" or "any", as `agoq search '
                                                          '--gradients` (omitted or null: any)')

    def request(self) -> SearchRequest:
        """The search request of these fields (null or omitted: the default); BadField naming the field refused."""
        return service_request({name: getattr(self, name) for name in ("budget", *CAP_FIELDS, *KNOB_FIELDS)})


class SaveRequest(PlanRequest):
    """A plan at one budget saved as ROOT/plans/NAME."""

    name: StrictStr = Field(..., description="file name (letters, digits, '.', '_', '-'; .json added when missing)")
    overwrite: StrictBool = Field(False, description="replace a file of that name (otherwise 409)")


def profile_folder(data: Dashboard, profile_id: str) -> Path:
    """The folder of a profile the search may read: every file it reads lies inside the root."""
    try:
        folder = data.catalog.folder(data.catalog.get("profiles", profile_id))
        folder.file("profile.json")
        table_file(folder, "table")
        table_file(folder, "collectives")
    except KeyError:
        shown = excerpt(profile_id)
        raise HTTPException(404, f"no profile named {shown} under the root (see /api/index)") from None
    except FormatError as e:
        raise HTTPException(422, f"profile {profile_id}: {e}") from None
    return folder.path


async def solved(fn: Callable[[], Awaitable[Any]]) -> Any:
    """await fn() with the planner's failures as HTTP answers."""
    try:
        return await fn()
    except Busy as e:
        raise HTTPException(503, str(e), headers={"Retry-After": str(e.retry_after)}) from None
    except TimeoutError as e:
        raise HTTPException(504, str(e)) from None
    except InfeasibleBudget as e:
        raise HTTPException(422, {"message": e.advice(), "smallest_budget_bytes": e.smallest_budget}) from None
    except (ValueError, FileNotFoundError, FormatError) as e:
        raise HTTPException(422, str(e)) from None


def read_request(body: PlanRequest) -> SearchRequest:
    """The search request of a body's fields; 422 naming the field refused."""
    try:
        return body.request()
    except BadField as e:
        raise HTTPException(422, str(e)) from None


async def plan_for(data: Dashboard, planner: Planner, body: PlanRequest) -> dict[str, Any]:
    """{profile, budget_bytes, caps, plan, predicted, ...} of the plan a body asks for (solved or cached)."""
    request = read_request(body)
    folder = await run_in_threadpool(profile_folder, data, body.profile)
    result = await solved(lambda: planner.plan(folder, request))
    return {"profile": body.profile, "budget_bytes": request.budget, "caps": request.caps, **result}


@router.post("/plan", summary="Solve a plan at a budget, as `agoq search` would",
             description="The plan `agoq search --profile P --budget B` writes (with the objective, caps, layout "
                         "and gradient storage given, else the command's defaults), solved by the same search in a pool of worker "
                         "threads. Answers {profile, budget_bytes, caps, plan, predicted: {peak_bytes, "
                         "peak_bytes_per_stage, step_seconds, tokens_per_step, tokens_per_second, grad_error}, "
                         "alternative (the best alternative the search priced, or null), notes, view: {summary, "
                         "bits, memory, figures} (as /api/plan?id= shows a plan), solve_seconds, cached}. "
                         "404: unknown profile; 422: bad budget or caps, a profile the search cannot read, or a "
                         "budget nothing fits (detail.smallest_budget_bytes says what does); 413: a body over "
                         f"{MAX_BODY_BYTES} bytes; 503 with "
                         "Retry-After: every worker busy and the queue full; 504: the solve outlasted the "
                         "timeout (it finishes in the background and is kept).")
async def api_plan_solve(body: PlanRequest, data: DashboardState, planner: PlannerState):
    result = await plan_for(data, planner, body)
    result["view"] = await run_in_threadpool(data.plan_view, result["plan"])
    return result


@router.get("/plan/range", summary="The budgets worth asking a profile's plan about",
            description="{profile, smallest_budget_bytes (the least any plan fits, no caps), largest_budget_bytes "
                        "(the peak of the plan that keeps everything), defaults: `agoq search`'s objective and caps, "
                        "objectives}; a profile the search cannot read answers {profile, error} so that its page "
                        "can say why.")
async def api_plan_range(data: DashboardState, planner: PlannerState,
                         profile: str = Query(..., description="profile folder, relative to the root")):
    folder = await run_in_threadpool(profile_folder, data, profile)
    try:
        found = await solved(lambda: planner.budget_range(folder))
    except HTTPException as e:
        if e.status_code != 422:
            raise
        return {"profile": profile, "error": str(e.detail)}
    return {"profile": profile, **found, "defaults": cap_defaults()}


@router.post("/plan/save", summary="Save the plan at a budget as ROOT/plans/NAME",
             description="Solves (or takes from the cache) the plan POST /api/plan gives for the same fields and "
                         "writes it, as `agoq search` writes a plan, to ROOT/plans/NAME atomically. 409 when the "
                         "file exists and `overwrite` is false; 403 from another machine unless the dashboard "
                         "has a token; 415 unless the body is JSON. Answers {id, path, overwritten}.")
async def api_plan_save(body: SaveRequest, data: DashboardState, planner: PlannerState,
                        _write: None = Depends(check_write)):
    # check_write as a dependency: it runs before the body is validated, so a body that is not JSON gets 415
    try:
        name = saved_plans.safe_name(body.name)
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    result = await plan_for(data, planner, body)
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
