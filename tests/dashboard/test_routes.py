"""The dashboard's routes against a recorded list: the OpenAPI document (/openapi.json) lists the same
operations (path, method, summary, tags, operationId, in the same order), and the app serves the
same pages and static files outside it, so that no route is dropped, renamed or moved into or out of the
document."""

from __future__ import annotations

import pytest
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
    ("/api/whatif", "get", "A profile's what-if plans over world sizes", ["api"], "api_whatif_api_whatif_get"),
]

# (path, what a GET of it answers on an empty root) of the pages and static files, kept out of the document; a
# path no route serves answers 404, and /static/{name} answers 404 for plotly.min.js if it is matched first
HIDDEN = [
    ("/", 200),
    ("/profile", 400),  # a page that wants ?id=: a page listing the ids it takes
    ("/search", 400),
    ("/plan", 400),
    ("/runs", 200),
    ("/whatif", 400),  # the what-if page of one profile
    ("/static/plotly.min.js", 200),
    ("/static/dashboard.js", 200),
    ("/static/planner.js", 200),
    ("/static/dashboard.css", 200),
    ("/favicon.ico", 204),
]

SCHEMAS = ["HTTPValidationError", "PlanRequest", "SaveRequest"]


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
    # a refused request is answered {"detail": words}, as the document says (not FastAPI's list of records)
    said = doc["components"]["schemas"]["HTTPValidationError"]["properties"]["detail"]
    assert said["type"] == "string"
    answered = TestClient(app).post("/api/plan", json={"profile": "p"}).json()
    assert set(answered) == {"detail"} and isinstance(answered["detail"], str)
    assert doc["info"]["title"] == "agoq dashboard" and doc["info"]["version"] == "1"


def test_pages_and_static_files_are_served_outside_the_document(app):
    client = TestClient(app)
    assert [(path, client.get(path).status_code) for path, _ in HIDDEN] == HIDDEN
    documented = client.get("/openapi.json").json()["paths"]
    assert not {path for path, _ in HIDDEN} & set(documented)
    for path, method, *_ in OPERATIONS:  # every documented operation is served (asked without its fields)
        assert client.request(method, path).status_code not in (404, 405), (method, path)
