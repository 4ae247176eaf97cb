"""The dashboard's routes against a recorded list: the OpenAPI document (/openapi.json) lists the same
operations (path, method, summary, tags, operationId, in the same order), and the app serves the same pages
and static files outside it, so that no route is dropped, renamed or moved into or out of the document."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from dashboard.app import create_app

# (path, method, summary, tags, operationId) of every operation in /openapi.json, in the document's order
OPERATIONS = [
    ("/api/index", "get", "Everything found under the root, with key figures", ["api"], "api_index_api_index_get"),
    ("/api/profile", "get", "A profile: key figures, heat maps, error curves, collectives", ["api"],
     "api_profile_api_profile_get"),
    ("/api/search", "get", "A search: Pareto front, chosen plan, Optuna studies", ["api"], "api_search_api_search_get"),
    ("/api/plan", "get", "A plan: key figures, bit widths, memory breakdown", ["api"], "api_plan_api_plan_get"),
    ("/api/plan", "post", "Solve a plan at a budget, as `agoq search` would", ["api"], "api_plan_solve_api_plan_post"),
    ("/api/run", "get", "A run: key figures and settings", ["api"], "api_run_api_run_get"),
    ("/api/curves", "get", "Runs' curves (loss, val loss, tokens/s, peak bytes per rank), thinned to `points` each",
     ["api"], "api_curves_api_curves_get"),
    ("/api/plan/range", "get", "The budgets worth asking a profile's plan about", ["api"],
     "api_plan_range_api_plan_range_get"),
    ("/api/plan/save", "post", "Save the plan at a budget as ROOT/plans/NAME", ["api"],
     "api_plan_save_api_plan_save_post"),
]

# (path, methods) of the routes kept out of the document (pages, static files), in the order they are matched
HIDDEN = [
    ("/", ["GET"]),
    ("/profile", ["GET"]),
    ("/search", ["GET"]),
    ("/plan", ["GET"]),
    ("/runs", ["GET"]),
    ("/static/plotly.min.js", ["GET"]),
    ("/static/{name}", ["GET"]),
    ("/favicon.ico", ["GET"]),
]

SCHEMAS = ["HTTPValidationError", "PlanRequest", "SaveRequest", "ValidationError"]


@pytest.fixture
def app(tmp_path):
    app = create_app(tmp_path)
    yield app
    app.state.planner.close()


def test_openapi_lists_the_recorded_operations(app):
    doc = TestClient(app).get("/openapi.json").json()
    listed = [(path, method, op.get("summary"), op.get("tags"), op.get("operationId"))
              for path, ops in doc["paths"].items() for method, op in ops.items()]
    assert listed == OPERATIONS
    assert sorted(doc["components"]["schemas"]) == SCHEMAS
    assert doc["info"]["title"] == "agoq dashboard" and doc["info"]["version"] == "1"


def test_pages_and_static_files_stay_out_of_the_document(app):
    hidden = [(r.path, sorted(r.methods)) for r in app.routes if isinstance(r, APIRoute) and not r.include_in_schema]
    assert hidden == HIDDEN
    shown = {(r.path, m.lower()) for r in app.routes if isinstance(r, APIRoute) and r.include_in_schema
             for m in r.methods}
    assert shown == {(path, method) for path, method, *_ in OPERATIONS}
