"""The HTML pages (/ overview, /profile, /search, /plan, /runs), drawn by dashboard.pages from what
dashboard.service.Dashboard reads (app.state.dashboard), and the static files they load (Plotly's bundle from
the installed plotly package, so the pages work offline). None of them is in the OpenAPI document. A page of
something that is not under the root is an HTML error page (404), one of a file that cannot be read 422; a page of
one thing asked for without ?id= is a 400 page listing the ids it takes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse

from agoq.formats.views import FormatError
from dashboard import pages
from dashboard.limits import MAX_COMPARE, clipped
from dashboard.service import MAX_POINTS_LIMIT, Dashboard
from dashboard.state import DashboardState

STATIC = Path(__file__).with_name("static")
STATIC_FILES = {"dashboard.js": "text/javascript", "planner.js": "text/javascript", "dashboard.css": "text/css"}

router = APIRouter(include_in_schema=False)


def plotly_bundle() -> Path:
    """plotly.min.js as shipped inside the installed plotly package."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall plotly (pip install --force-reinstall plotly)")
    return path


def page(title: str, fn: Callable[[], str]) -> HTMLResponse:
    """The page fn() draws, or an error page saying what is missing (404) or cannot be read (422)."""
    try:
        return HTMLResponse(fn())
    except KeyError as e:
        return HTMLResponse(pages.error_page(title, f"nothing named {clipped(e.args[0] if e.args else e)} "
                                                    "under the root (see the overview)"), status_code=404)
    except (FormatError, ValueError) as e:
        return HTMLResponse(pages.error_page(title, str(e)), status_code=422)


@router.get("/", response_class=HTMLResponse)
def overview_page(data: DashboardState, refresh: bool = False):
    return page("overview", lambda: pages.overview(data.overview(refresh=refresh)))


def missing_id(data: Dashboard, title: str, kind: str) -> HTMLResponse:
    """400: a page of one artifact asked for without ?id=, listing the ids it takes (each a link to its page)."""
    ids = sorted(data.catalog.index().items[kind])
    shown = pages.Page(title)
    shown.add(pages.message(f"The {title} page shows one {title}: add ?id=ID to the address, ID one of the "
                            f"{kind} found under the root (as the overview and /api/index list them).", "error"))
    if ids:
        shown.add("<ul>" + "".join(f'<li><a href="{pages.esc(pages.link("/" + title, id=i))}">{pages.esc(i)}</a></li>'
                                   for i in ids[:200]) + "</ul>")
        if len(ids) > 200:
            shown.add(f"<p class=meta>and {len(ids) - 200} more (see the overview)</p>")
    else:
        shown.add(pages.message(f"No {kind} under the root yet.", "empty"))
    shown.add("<p><a href='/'>back to the overview</a></p>")
    return HTMLResponse(shown.render(), status_code=400)


@router.get("/profile", response_class=HTMLResponse)
def profile_page(data: DashboardState, id: str | None = None, option: str | None = None):
    if id is None:
        return missing_id(data, "profile", "profiles")
    return page("profile", lambda: pages.profile(data.profile(id, option), data.planner_start(id)))


@router.get("/search", response_class=HTMLResponse)
def search_page(data: DashboardState, id: str | None = None):
    if id is None:
        return missing_id(data, "search", "searches")
    return page("search", lambda: pages.search(data.search(id)))


@router.get("/plan", response_class=HTMLResponse)
def plan_page(data: DashboardState, id: str | None = None):
    if id is None:
        return missing_id(data, "plan", "plans")
    return page("plan", lambda: pages.plan(data.plan(id)))


def compared_runs(data: Dashboard, ids: list[str], points: int, x: str) -> str:
    """The /runs page: every run, the curves of `ids` (the first MAX_COMPARE; none given: the 6 newest runs)."""
    everything = data.overview()["runs"]
    selected = list(dict.fromkeys(ids))[:MAX_COMPARE]
    if not ids:
        newest = sorted((r for r in everything if "error" not in r),
                        key=lambda r: str(r.get("updated") or ""), reverse=True)
        selected = [r["id"] for r in newest[:6]]
    chosen, errors = [], []
    for run_id in selected:
        try:
            chosen.append(data.curves(run_id, points))
        except KeyError:
            errors.append(f"no run named {run_id} under the root")
        except FormatError as e:
            errors.append(f"{run_id}: {e}")
    return pages.runs(everything, chosen, selected, errors, x)


@router.get("/runs", response_class=HTMLResponse)
def runs_page(data: DashboardState, id: list[str] = Query([]), points: int = Query(2000, ge=4, le=MAX_POINTS_LIMIT),
              x: str = Query("step", pattern="^(step|time)$")):
    return page("runs", lambda: compared_runs(data, id, points, x))


@router.get("/static/plotly.min.js")
def plotly_js():
    return FileResponse(plotly_bundle(), media_type="text/javascript", headers={"cache-control": "max-age=86400"})


@router.get("/static/{name}")
def static(name: str):
    if name not in STATIC_FILES:
        raise HTTPException(404, "no such file")
    return FileResponse(STATIC / name, media_type=STATIC_FILES[name])


@router.get("/favicon.ico")
def favicon():
    return PlainTextResponse("", status_code=204)
