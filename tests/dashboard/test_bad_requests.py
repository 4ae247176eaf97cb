"""Every bad request to the dashboard gets a plain-words answer: a 4xx whose message names the parameter or field
and says what to send (JSON {"detail": text} under /api/, an HTML page with a link back to the overview elsewhere),
never pydantic's list of error records, a 5xx or a wait."""

from __future__ import annotations

import html
import json
import re

import pytest
from fastapi.testclient import TestClient

from dashboard.app import create_app

# pydantic's own words and record keys: none may reach an answer
PYDANTIC = ("Input should", "Field required", "Extra inputs", '"loc"', '"msg"', "model_attributes_type", "json_invalid")
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(synthetic_root):
    app = create_app(synthetic_root)
    yield TestClient(app, client=("127.0.0.1", 50000))  # from this machine: saving is allowed, so bodies are read
    app.state.planner.close()


def plain(r, status: int, *words: str) -> str:
    """The answer's message, checked to be `status`, plain words (no pydantic records) holding every one of
    `words`."""
    assert r.status_code == status, (r.status_code, r.text[:400])
    if r.headers["content-type"].startswith("application/json"):
        detail = r.json()["detail"]
        assert isinstance(detail, str), detail
        text = detail
    else:
        assert r.headers["content-type"].startswith("text/html")
        assert "href='/'" in r.text  # a way back to the overview
        text = html.unescape(re.sub(r"<[^>]+>", " ", r.text.split("<main>", 1)[1]))
    for w in PYDANTIC:
        assert w not in r.text, (w, r.text[:400])
    for w in words:
        assert w in text, (w, text)
    assert len(text) < 1200, text
    return text


@pytest.mark.parametrize("path", ["/api/profile", "/api/search", "/api/plan", "/api/run", "/api/curves"])
def test_an_api_without_its_id_says_to_add_it(client, path):
    plain(client.get(path), 422, "query parameter id is missing", "?id=", "/api/index")


def test_the_plan_range_without_a_profile_says_so(client):
    plain(client.get("/api/plan/range"), 422, "query parameter profile is missing", "?profile=")


@pytest.mark.parametrize("page,kind", [("/profile", "profiles"), ("/search", "searches"), ("/plan", "plans")])
def test_a_page_without_its_id_lists_the_ids_it_takes(client, page, kind):
    """400 with a link to each id of that kind, as /api/index lists them (an independent reading of the root)."""
    r = client.get(page)
    text = plain(r, 400, "?id=")
    ids = [item["id"] for item in client.get("/api/index").json()[kind]]
    assert ids
    for i in ids:
        assert f'href="{page}?id={i}"' in r.text and i in text


@pytest.mark.parametrize("params,words", [({"id": "runs/long", "points": "many"}, ("points", "whole number", "many")),
                                         ({"id": "runs/long", "points": 2}, ("points", "greater than or equal to 4"))])
def test_query_parameters_of_the_wrong_type_or_size(client, params, words):
    plain(client.get("/api/curves", params=params), 422, *words)


def test_a_page_parameter_out_of_its_choices_is_a_page(client):
    plain(client.get("/runs", params={"x": "sideways"}), 422, "query parameter x", "step or time", "sideways")
    plain(client.get("/runs", params={"points": "lots"}), 422, "query parameter points", "whole number")


@pytest.mark.parametrize("path", ["/api/plan", "/api/plan/save"])
@pytest.mark.parametrize("body,words", [
    (b"{not json", ("not valid JSON", "send a JSON object", '"budget"')),
    (b"", ("no body", "send a JSON object")),
    (b"[1, 2]", ("must be a JSON object", "[1, 2]")),
    (b"null", ("must be a JSON object",)),
    (b'"4GB"', ("must be a JSON object", "4GB")),
    (b"\xff\xfe{", ("cannot be read as JSON text", "send a JSON object")),
])
def test_a_body_that_is_not_a_json_object(client, path, body, words):
    plain(client.post(path, content=body, headers=JSON), 400, *words)


def test_a_body_sent_as_text_is_told_to_be_json(client):
    plain(client.post("/api/plan", content=b"profile=prof&budget=4GB", headers={"content-type": "text/plain"}),
          400, "not JSON", "Content-Type: application/json")


@pytest.mark.parametrize("body,words", [
    ({"budget": "1GB"}, ("field profile is missing", "profile folder")),
    ({"profile": "prof"}, ("field budget is missing", "4GB")),
    ({"profile": 3, "budget": "1GB"}, ("field profile", "expected text", "got 3")),
    ({"profile": "prof", "budget": {"a": 1}}, ("field budget", "a whole number, a number or text", '{"a": 1}')),
    ({"profile": "prof", "budget": "1GB", "objective": 5}, ("field objective", "expected text", "got 5")),
    ({"profile": "prof", "budget": "1GB", "layout": ["fsdp"]}, ("field layout", "expected text")),
    ({"profile": "prof", "budget": "1GB", "budgets": 3}, ("field budgets is not one", "send only profile, budget")),
])
def test_fields_missing_unknown_or_of_the_wrong_type(client, body, words):
    plain(client.post("/api/plan", content=json.dumps(body), headers=JSON), 422, *words)


def test_two_wrong_fields_are_both_named(client):
    text = plain(client.post("/api/plan", json={"profile": [], "budget": "1GB", "time_cap": {}}), 422,
                 "field profile", "field time_cap")
    assert text.count(";") == 1


def test_a_save_field_of_the_wrong_type(client):
    body = {"profile": "prof", "budget": "1GB", "name": "p", "overwrite": "yes"}
    plain(client.post("/api/plan/save", json=body), 422, "field overwrite", "true or false", "yes")


def test_unknown_ids_and_bad_values_stay_plain(client):
    """What the routes refuse themselves (unknown id, a budget the rules refuse) is plain words too."""
    plain(client.get("/api/profile", params={"id": "no/such"}), 404, "no/such")
    plain(client.get("/profile", params={"id": "no/such"}), 404, "nothing named no/such")
    plain(client.post("/api/plan", json={"profile": "prof", "budget": "lots"}), 422, "budget")
