"""The read-only JSON API: /api/index, /api/profile, /api/search, /api/plan (GET), /api/run, /api/curves.
Each answers what dashboard.service.Dashboard reads (app.state.dashboard) as it is: an id that names nothing
under the root is 404, a file that cannot be read (or a bad choice, say an unknown option) 422."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, HTTPException, Query

from agoq.formats.views import FormatError
from dashboard.limits import MAX_COMPARE, clipped
from dashboard.service import MAX_POINTS_LIMIT
from dashboard.state import DashboardState

router = APIRouter(prefix="/api", tags=["api"])


def answer(fn: Callable[[], Any]) -> Any:
    """fn(), with an unknown id (KeyError) as 404 and a broken file or bad choice as 422."""
    try:
        return fn()
    except KeyError as e:
        raise HTTPException(404, f"not found under the root: {clipped(e.args[0] if e.args else e)}") from None
    except (FormatError, ValueError) as e:
        raise HTTPException(422, str(e)) from None


@router.get("/index", summary="Everything found under the root, with key figures",
            description="`profiles`, `searches`, `plans`, `runs`: lists of {id, key figures...} or {id, error}; "
                        "`problems`: paths skipped (e.g. symlinks leading outside the root); `scanned_at`: epoch s.")
def api_index(data: DashboardState,
              refresh: bool = Query(False, description="rescan now instead of within the cache time")):
    return data.overview(refresh=refresh)


@router.get("/profile", summary="A profile: key figures, heat maps, error curves, collectives",
            description="`maps`: layers x kinds grids of `sensitivity` (relative L2 of all weight gradients), "
                        "`bytes` (kept per micro-batch) and `quant_error` at `option`; `curves`: per kind and format, "
                        "mean errors against bits; `times`: per kind, the mean seconds each option adds (quantize + dequantize per "
                        "bit width, recompute); `collectives`: seconds against message bytes per (op, path). "
                        "A part that cannot be read is {error}.")
def api_profile(data: DashboardState, id: str = Query(..., description="profile folder, relative to the root"),
                option: str | None = Query(None, description='option of the heat maps ("4", "recompute"...)')):
    return answer(lambda: data.profile(id, option))


@router.get("/search", summary="A search: Pareto front, chosen plan, Optuna studies",
            description="`pareto`: pareto.csv rows (numbers parsed; `validated`, `plan_id`); `chosen_plan`: as "
                        "/api/plan; `study`: {file, studies: [{name, directions, objectives, states, trials}]}.")
def api_search(data: DashboardState, id: str = Query(..., description="search folder, relative to the root")):
    return answer(lambda: data.search(id))


@router.get("/plan", summary="A plan: key figures, bit widths, memory breakdown",
            description="`bits`: layers x kinds (16, 2..8, 0 = recompute, -1 = layer checkpointed); `memory`: per "
                        "stage, the parts of the predicted peak the plan records (bytes on one rank at the phase "
                        "that sets the peak, `phases`; they add up to the peak; none for plans before schema 1.2) "
                        "and measured peaks; `cluster` (null for one rank): the layout as dimensions with its "
                        "data ranks, and its profile's layout steps beside their model and calibrated prices; "
                        "`runs`: runs that trained with this plan.")
def api_plan(data: DashboardState, id: str = Query(..., description="plan file, relative to the root")):
    return answer(lambda: data.plan(id))


@router.get("/run", summary="A run: key figures and settings")
def api_run(data: DashboardState, id: str = Query(..., description="run folder, relative to the root")):
    return answer(lambda: data.run(id))


@router.get("/curves", summary="Runs' curves (loss, val loss, tokens/s, peak bytes per rank), thinned to `points` each",
            description="Per run: `series.{loss, val_loss, tokens_per_s, grad_norm, step_seconds, lr}` = {step, "
                        "value, elapsed_s} and `peak_bytes` = [{rank, step, value, elapsed_s}]; `train_points` and "
                        "`val_points` count the lines before thinning (lowest and highest point per bucket).")
def api_curves(data: DashboardState, id: list[str] = Query(..., description="run folder(s), relative to the root"),
               points: int = Query(2000, ge=4, le=MAX_POINTS_LIMIT,
                                   description="most points per curve (min and max per bucket are kept)")):
    if len(id) > MAX_COMPARE:
        raise HTTPException(422, f"at most {MAX_COMPARE} runs at once")
    return {"runs": [answer(lambda i=i: data.curves(i, points)) for i in id]}
