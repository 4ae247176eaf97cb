"""`agoq search` and the dashboard's POST /api/plan read a search request by the same rules: over one table of
values, both accept the same ones and make the same SearchRequest of them (the search itself is replaced by a
recorder here), and both refuse the same ones in the same words, the command line naming the flag
(argument --time-cap: ...), the service the JSON field (time_cap: ...)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agoq.cli import main
from agoq.search.request import InfeasibleBudget
from dashboard.app import create_app
from dashboard.planner import SERVICE_FIXED
from tests.search.synthetic_profile import write_profile

search_module = importlib.import_module("agoq.search.search")  # the module (agoq.search.search is the function too)
SEED = int.from_bytes(os.urandom(4), "little")
RNG = random.Random(SEED)
GIB, TIB = 2**30, 2**40


class Refused(str):
    """A value the rules refuse; the string is a fragment of the words they say why with."""


# field, value as the command line gives it, and what it reads as (worked out here, not by the rules) or Refused
_random_bytes = RNG.randrange(10**6, 10**12)
_random_gib = round(RNG.uniform(0.5, 900.0), 3)
_random_seconds = round(RNG.uniform(1e-3, 50.0), 6)
CASES = [
    ("budget", "30GiB", 30 * GIB),
    ("budget", "1.5GB", 1_500_000_000),
    ("budget", " 512MiB ", 512 * 2**20),
    ("budget", "1e9", 10**9),
    ("budget", str(_random_bytes), _random_bytes),
    ("budget", f"{_random_gib}GiB", int(round(_random_gib * GIB))),
    ("budget", "1024TiB", 1024 * TIB),  # the most
    ("budget", "1", 1),
    ("budget", "0", Refused("more than 0")),
    ("budget", "0.4", Refused("more than 0")),
    ("budget", "-2GiB", Refused("more than 0")),
    ("budget", "1025TiB", Refused("more than any GPU")),
    ("budget", "1e30", Refused("more than any GPU")),
    ("budget", "1e400", Refused("too large")),
    ("budget", "lots", Refused("cannot read")),
    ("budget", "nan", Refused("cannot read")),
    ("budget", "inf", Refused("cannot read")),
    ("budget", "3 GiB of RAM", Refused("cannot read")),
    ("budget", "7" * 3000 + "!", Refused("3003 characters")),  # quoted short (its repr's length), read in linear time
    ("time_cap", "0.5", 0.5),
    ("time_cap", repr(_random_seconds), _random_seconds),
    ("time_cap", "checkpoint", "checkpoint"),
    ("time_cap", "none", None),
    ("time_cap", "0", Refused("> 0")),
    ("time_cap", "-1", Refused("> 0")),
    ("time_cap", "inf", Refused("finite")),
    ("time_cap", "nan", Refused("finite")),
    ("time_cap", "recipe", Refused("'checkpoint' or 'none'")),
    ("time_cap", "fast", Refused("'checkpoint' or 'none'")),
    ("error_cap", "0", 0.0),
    ("error_cap", "0.25", 0.25),
    ("error_cap", "recipe", "recipe"),
    ("error_cap", "none", None),
    ("error_cap", "-0.1", Refused(">= 0")),
    ("error_cap", "1e999", Refused("finite")),
    ("error_cap", "checkpoint", Refused("'recipe' or 'none'")),
    ("objective", "time", "time"),
    ("objective", "error", "error"),
    ("objective", "fastest", Refused("invalid choice")),
    ("objective", "Time", Refused("invalid choice")),
]
BUDGET = "3GiB"  # the budget of the cases of other fields


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rules").resolve()
    write_profile(root / "prof", random.Random(SEED), micro_batch=2, seq_len=29)
    return root


@pytest.fixture(scope="module")
def client(root):
    app = create_app(root)
    yield TestClient(app)
    app.state.planner.close()


@pytest.fixture
def recorded(monkeypatch) -> list:
    """The requests the search is asked (it answers each with InfeasibleBudget, smallest budget 7 bytes)."""
    asked: list = []

    def recorder(profile, request, **run):
        asked.append(request)
        raise InfeasibleBudget("recorded", 7)

    monkeypatch.setattr(search_module, "search", recorder)
    return asked


def _cli(root: Path, tmp_path: Path, field: str, text: str, capsys) -> tuple[bool, str]:
    """(whether `agoq search` reached the search, the error line it printed)."""
    budget = text if field == "budget" else BUDGET
    argv = ["search", "--profile", str(root / "prof"), f"--budget={budget}", "--out", str(tmp_path / "p.json"),
            "--quiet"]
    if field != "budget":
        argv.append(f"--{field.replace('_', '-')}={text}")  # one word: a value may start with '-' 
    try:
        code = main(argv)
    except SystemExit as e:  # argparse refused a value
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, err
    return "recorded" in err, err


def _service(client: TestClient, field: str, value) -> tuple[bool, object]:
    """(whether POST /api/plan reached the search, its detail)."""
    body = {"profile": "prof", "budget": value if field == "budget" else BUDGET}
    if field != "budget":
        body[field] = value
    r = client.post("/api/plan", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    return isinstance(detail, dict), detail


def _as_json_number(text: str):
    """The JSON number `text` is, or None when it is none (a size with a unit, a word)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@pytest.mark.parametrize("case", CASES, ids=[f"{field}={text[:24]}" for field, text, _ in CASES])
def test_the_command_and_the_service_read_alike(case, root, client, tmp_path, recorded, capsys):
    """(the random values are in the test ids)"""
    field, text, want = case
    reached_cli, err = _cli(root, tmp_path, field, text, capsys)
    reached_service, detail = _service(client, field, text)
    assert reached_cli == reached_service == (not isinstance(want, Refused)), (err, detail)
    if isinstance(want, Refused):
        flag = "--" + field.replace("_", "-")
        assert err.startswith(f"agoq search: error: argument {flag}: "), err
        problem = err.split(f"argument {flag}: ", 1)[1]
        assert detail == f"{field}: {problem}"  # the same words, under the JSON field's name
        assert want in problem and "--" not in detail
        assert len(detail) < 300, detail  # bad input quoted as an excerpt, whatever its length
        assert recorded == []
        return
    cli_request, service_request = recorded
    assert getattr(cli_request, field) == want
    assert dataclasses.replace(cli_request, **SERVICE_FIXED) == service_request
    assert detail == {"message": "recorded: give budget 7 or more", "smallest_budget_bytes": 7}
    assert "give --budget 7 or more" in err and str(root / "prof") in err
    number = _as_json_number(text)
    if number is not None:  # the same value as a JSON number: the same request
        reached, _ = _service(client, field, number)
        assert reached and recorded[-1] == service_request


@pytest.mark.parametrize("field,number", [("budget", 0), ("budget", -4096), ("budget", 2**50 + 1), ("budget", 1e30),
                                          ("budget", 0.49), ("time_cap", 0), ("time_cap", -2.5),
                                          ("error_cap", -1e-9)])
def test_numbers_out_of_range_are_refused_as_their_text_is(field, number, root, client, tmp_path, recorded, capsys):
    """A JSON number out of range is refused as the command line refuses its text, in the same words (the value
    quoted as each was given)."""
    text = repr(number)
    reached_cli, err = _cli(root, tmp_path, field, text, capsys)
    reached_service, detail = _service(client, field, number)
    assert not reached_cli and not reached_service and recorded == []
    flag = "--" + field.replace("_", "-")
    problem = err.split(f"argument {flag}: ", 1)[1]
    assert detail.startswith(f"{field}: ")
    assert detail == f"{field}: {problem.replace(repr(text), text)}"  # the text quoted as a string, the number bare


def test_null_and_omitted_are_the_defaults(root, client, tmp_path, recorded, capsys):
    """JSON null or an omitted field is the command's default (error cap 'recipe', no time cap, objective
    time); 'none' is no cap on both."""
    assert _service(client, "budget", BUDGET)[0]
    assert _service(client, "error_cap", None)[0] and _service(client, "time_cap", None)[0]
    assert _cli(root, tmp_path, "objective", "time", capsys)[0]
    omitted, null_cap, null_time, cli = recorded
    assert omitted == null_cap == null_time == dataclasses.replace(cli, **SERVICE_FIXED)
    assert (omitted.objective, omitted.time_cap, omitted.error_cap) == ("time", None, "recipe")
    assert _service(client, "error_cap", "none")[0] and recorded[-1].error_cap is None
