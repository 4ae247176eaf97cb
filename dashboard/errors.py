"""Bad requests answered in words: FastAPI's validation errors (a query parameter missing or of the wrong type, a
body that is not JSON, not an object, or whose fields are missing, unknown or of the wrong type) become one short
message naming the parameter or field, what it should be and what was sent, instead of pydantic's list of error
records. The API answers {"detail": MESSAGE} (JSON), a page an HTML page with a link back to the overview.

Status: 400 when the body cannot be read as a request at all (not JSON, not a JSON object, none sent), 422 when it
can but a parameter or field is wrong (FastAPI's status for those, which the API documents). Input is quoted as a
short excerpt (dashboard.limits.quoted), at most MAX_ERRORS problems are listed."""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from agoq.units import excerpt
from dashboard.limits import MAX_ERRORS, clipped, quoted
from dashboard.pages import error_page

EXAMPLE_BODY = '{"profile": "profile", "budget": "4GB"}'
# what pydantic's error types expect, in words
EXPECTED = {"string_type": "text (a JSON string)", "int_type": "a whole number", "int_parsing": "a whole number",
            "int_from_float": "a whole number", "float_type": "a number", "float_parsing": "a number",
            "bool_type": "true or false", "bool_parsing": "true or false", "dict_type": "a JSON object",
            "model_attributes_type": "a JSON object", "model_type": "a JSON object", "list_type": "a list"}
PLACES = {"query": "query parameter", "body": "field", "path": "path parameter", "header": "header",
          "cookie": "cookie"}
BODY_UNREADABLE = ("json_invalid", "model_attributes_type", "model_type", "dict_type", "missing")


def _route_fields(request: Request) -> tuple[dict[tuple[str, str], str], list[str]]:
    """((place, name) -> the description the route gives that parameter or field, the body's field names) of the
    route the request was matched to (both empty when unknown)."""
    notes: dict[tuple[str, str], str] = {}
    body: list[str] = []
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return notes, body
    for place in ("query", "path", "header", "cookie"):
        for param in getattr(dependant, f"{place}_params", []):
            description = getattr(param.field_info, "description", None)
            if description:
                notes[(place, param.alias)] = description
    for param in getattr(dependant, "body_params", []):
        model = getattr(param.field_info, "annotation", None)
        for name, info in (getattr(model, "model_fields", None) or {}).items():
            body.append(name)
            if info.description:
                notes[("body", name)] = info.description
    return notes, body


def _pattern_words(pattern: str) -> str | None:
    """'step or time' for a pattern ^(step|time)$ (a choice of plain words), else None."""
    m = re.fullmatch(r"\^\(([\w|.-]+)\)\$", pattern or "")
    if not m:
        return None
    words = m.group(1).split("|")
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def _got(value: Any) -> str:
    """'got ...': what was sent, quoted short (text in quotes, anything else as JSON)."""
    if isinstance(value, (bytes, bytearray)):
        return "got a body that is not JSON"
    shown = quoted(value)
    if isinstance(shown, str):
        return f"got {shown!r}"
    try:
        return f"got {json.dumps(shown)}"
    except (TypeError, ValueError):
        return f"got {excerpt(shown)}"


def _send(body: list[str]) -> str:
    """What to send instead: a JSON object of the route's body fields."""
    fields = f" (fields: {', '.join(body)})" if body else ""
    return f"send a JSON object such as {EXAMPLE_BODY}{fields}, with Content-Type: application/json"


def _body_problem(error: dict[str, Any], body: list[str]) -> str:
    """What is wrong with a body that cannot be read as a request at all, and what to send."""
    send = _send(body)
    kind = error.get("type")
    if kind == "json_invalid":
        why = (error.get("ctx") or {}).get("error")
        where = error.get("loc", ("body", None))[1:2]
        at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        return f"the request body is not valid JSON ({why or 'cannot parse it'}{at}): {send}"
    if kind == "missing":
        return f"the request has no body: {send}"
    if isinstance(error.get("input"), (bytes, bytearray)):
        return f"the request body is not JSON: {send}"
    return f"the request body must be a JSON object, {_got(error.get('input'))}: {send}"


def _problem(place: str, name: str, errors: list[dict[str, Any]], note: str | None, body: list[str]) -> str:
    """One parameter's or field's problem in words: which one, what it should be, what was sent."""
    what = f"{PLACES.get(place, place)} {clipped(name)}"
    first = errors[0]
    kind = first.get("type")
    if kind == "missing":
        if place == "query":
            ids = "; /api/index and the overview list the ids" if name in ("id", "profile") else ""
            return f"{what} is missing: add ?{name}=VALUE to the address ({note or 'see /docs'}){ids}"
        return f"{what} is missing: give {note}" if note else f"{what} is missing"
    if kind == "extra_forbidden":
        allowed = f": send only {', '.join(body)}" if body else ""
        return f"{what} is not one this request takes{allowed}"
    expected = list(dict.fromkeys(EXPECTED[e["type"]] for e in errors if e.get("type") in EXPECTED))
    if expected:
        hint = f" ({note})" if note else ""
        words = ", ".join(expected[:-1]) + " or " + expected[-1] if len(expected) > 1 else expected[0]
        return f"{what}{hint}: expected {words}, {_got(first.get('input'))}"
    if kind == "string_pattern_mismatch":
        words = _pattern_words(str((first.get("ctx") or {}).get("pattern", "")))
        if words:
            return f"{what}: expected {words}, {_got(first.get('input'))}"
    msg = str(first.get("msg") or "not accepted")
    msg = re.sub(r"^Input should be ", "should be ", msg)
    msg = msg[:1].lower() + msg[1:]
    return f"{what}: {msg}, {_got(first.get('input'))}"


def explain(errors: Iterable[dict[str, Any]], request: Request | None = None) -> tuple[int, str]:
    """(status, message) of FastAPI's validation errors: the problems in words, one per parameter or field."""
    errors = list(errors)
    notes, body = _route_fields(request) if request is not None else ({}, [])
    for e in errors:
        loc = tuple(e.get("loc") or ())
        if loc[:1] == ("body",) and (len(loc) == 1 or e.get("type") == "json_invalid") \
                and e.get("type") in BODY_UNREADABLE:
            return 400, _body_problem(e, body)
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in errors:
        loc = tuple(e.get("loc") or ())
        place = str(loc[0]) if loc else "request"
        name = "".join([str(p) for p in loc[1:2]] + [f"[{p}]" for p in loc[2:] if isinstance(p, int)]) or "?"
        grouped.setdefault((place, name), []).append(e)
    problems = [_problem(place, name, errs, notes.get((place, name)), body)
                for (place, name), errs in list(grouped.items())[:MAX_ERRORS]]
    if len(grouped) > MAX_ERRORS:
        problems.append(f"and {len(grouped) - MAX_ERRORS} more")
    return 422, "; ".join(problems) or "the request was not accepted"


UNPARSED_BODY = "There was an error parsing the body"  # FastAPI's words for a body it could not decode


async def http_errors(request: Request, exc: StarletteHTTPException) -> Response:
    """FastAPI's own HTTP errors as it answers them, except a body it could not decode (not UTF-8, say), which is
    answered like any other unreadable body: what to send."""
    if exc.status_code == 400 and exc.detail == UNPARSED_BODY:
        _, body = _route_fields(request)
        text = f"the request body cannot be read as JSON text (UTF-8): {_send(body)}"
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": text}, status_code=400)
        return HTMLResponse(error_page("bad request", text), status_code=400)
    return await http_exception_handler(request, exc)


async def validation_errors(request: Request, exc: RequestValidationError) -> Response:
    """The answer to a request FastAPI refused: {"detail": message} under /api/, an HTML error page elsewhere."""
    status, text = explain(exc.errors(), request)
    if request.url.path.startswith("/api/"):
        return JSONResponse({"detail": text}, status_code=status)
    return HTMLResponse(error_page("bad request", text), status_code=status)


def document_errors(app: FastAPI, document: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI `document` saying what a refused request is answered (FastAPI's own says a list of validation
    records): HTTPValidationError is {"detail": message}, and pydantic's ValidationError record is gone."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    if "HTTPValidationError" in schemas:
        schemas["HTTPValidationError"] = {
            "title": "HTTPValidationError", "type": "object", "required": ["detail"],
            "properties": {"detail": {"title": "Detail", "type": "string",
                                      "description": "what was wrong, in words: the parameter or field, what it "
                                                     "takes and what was sent (400 for a body that is not a JSON "
                                                     "object)"}}}
        schemas.pop("ValidationError", None)
    app.openapi_schema = document
    return document
