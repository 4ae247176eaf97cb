"""The what-if page (/whatif) and its JSON (/api/whatif): a profile's plans for clusters it was not measured on,
2..max_world ranks in nodes of node_size over a network (dashboard.whatif). An unknown profile id is 404, settings
that cannot describe a cluster (an unknown network preset, a bad budget) 422."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import HTMLResponse

from agoq.formats.views import FormatError
from dashboard import pages, whatif
from dashboard.limits import clipped
from dashboard.profiles import header
from dashboard.routes_pages import missing_id
from dashboard.state import DashboardState

router = APIRouter()

NETWORK = Query(None, description="the cluster's links: a preset (ib-ndr400, nvlink-h100+roce-100g, ...) or "
                                  "intra=GBps@us,inter=GBps@us; none: the profile's own link, fitted")
NODE = Query(None, ge=1, description="ranks per node (default: the profiled machine's GPUs)")
BUDGET = Query(None, description="memory budget per GPU, e.g. 80GB (default: the profiled GPU's memory)")
MAX_WORLD = Query(whatif.DEFAULT_MAX_WORLD, description=f"largest world size, 2..{whatif.MAX_WORLD}")


def _answer(data, id: str, network, node_size, budget, max_world):
    """(settings, what-if) of profile `id`; KeyError for an unknown id, ValueError/FormatError for bad settings."""
    folder = data.catalog.folder(data.catalog.get("profiles", id))
    memory = ((header(folder).get("hardware") or {}).get("memory_bytes"))
    settings = whatif.read_settings(network, node_size, budget, max_world, memory)
    return settings, whatif.whatif(folder.path, settings)


@router.get("/api/whatif", tags=["api"], summary="A profile's what-if plans over world sizes",
            description="`rows`: per world size and layout {world_size, node_size, layout, gradients, found, "
                        "tokens_per_second (the cluster's), tokens_per_second_per_rank, step_seconds, peak_bytes "
                        "(per rank), knobs, reason}; `network` {name, source}; `fit` of the profile's collectives "
                        "(null: none measured); `check_first`: what to run on the real cluster first.")
def api_whatif(data: DashboardState, id: str = Query(..., description="profile folder, relative to the root"),
               network: str | None = NETWORK, node_size: int | None = NODE, budget: str | None = BUDGET,
               max_world: int = MAX_WORLD):
    try:
        return _answer(data, id, network, node_size, budget, max_world)[1]
    except KeyError as e:
        raise HTTPException(404, f"not found under the root: {clipped(e.args[0] if e.args else e)}") from None
    except (FormatError, ValueError) as e:
        raise HTTPException(422, str(e)) from None


@router.get("/whatif", response_class=HTMLResponse, include_in_schema=False)
def whatif_page(data: DashboardState, id: str | None = None, network: str | None = None,
                node_size: int | None = Query(None, ge=1), budget: str | None = None,
                max_world: int = whatif.DEFAULT_MAX_WORLD):
    if id is None:
        return missing_id(data, "whatif", "profiles")
    try:
        settings, answer = _answer(data, id, network, node_size, budget, max_world)
    except KeyError as e:
        return HTMLResponse(pages.error_page("what-if", f"nothing named {clipped(e.args[0] if e.args else e)} "
                                                        "under the root (see the overview)"), status_code=404)
    except (FormatError, ValueError) as e:
        return HTMLResponse(pages.error_page("what-if", str(e)), status_code=422)
    return HTMLResponse(whatif.page(id, answer, settings))
