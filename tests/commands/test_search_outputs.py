"""What `agoq search` writes and prints besides its plan: an --out that is not an agoq plan is refused; every side
file is named after the plan, so a second search in the same folder changes none of the first one's (and the
dashboard still finds and reads them); the cost model's notes are summed up in one line unless --verbose; a request
for offload from a profile that did not measure the host link says why nothing offloads."""

import hashlib
import json
import random

import pytest

from agoq.cli import main
from agoq.formats.plan import is_plan_file, load_plan
from tests.commands.test_search import PIN, _bounds, _rows
from tests.search.synthetic_profile import write_profile


@pytest.fixture
def profile_dir(tmp_path):
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return write_profile(tmp_path / "profile", random.Random(seed), micro_batch=2, seq_len=40)


def _search(profile_dir, out, budget, *extra):
    return main(["search", "--profile", str(profile_dir), "--budget", str(budget), "--out", str(out), "--quiet",
                 *PIN, *extra])


def _digest(folder):
    """Every file under `folder`, by relative path, with a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("content", ['{"learning_rate": 0.001}', "not json at all\n", "[1, 2, 3]",
                                     '{"schema": "agoq.profile/1"}', ""])
def test_an_out_that_is_not_a_plan_is_refused_and_kept(profile_dir, tmp_path, capsys, content):
    low, high = _bounds(profile_dir)
    out = tmp_path / "results.json"
    out.write_text(content)
    assert _search(profile_dir, out, (low + high) // 2, "--front-budgets", "2") == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not an agoq plan" in err and "another --out" in err
    assert "Traceback" not in err
    assert out.read_text() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile", "results.json"]  # nothing else written


def test_two_searches_in_one_folder_keep_their_own_files(profile_dir, tmp_path, capsys):
    """Each search's front, front plans and study are named after its plan: the second search into the folder leaves
    every file of the first one as it was, and its own front lists its own plans."""
    low, high = _bounds(profile_dir)
    folder = tmp_path / "searches"
    small, large = folder / "small.json", folder / "large.json"
    assert _search(profile_dir, small, low + (high - low) // 4, "--front-budgets", "3", "--method", "both",
                   "--trials", "2") == 0
    first = _digest(folder)
    assert {"small.json", "small.pareto.csv", "small.study.db"} <= set(first)
    assert _search(profile_dir, large, high, "--front-budgets", "3", "--method", "both", "--trials", "2") == 0
    after = _digest(folder)
    assert {k: after[k] for k in first} == first  # none of the first search's files changed
    assert {"large.json", "large.pareto.csv", "large.study.db"} <= set(after)
    for stem, budget in (("small", low + (high - low) // 4), ("large", high)):
        assert load_plan(folder / f"{stem}.json").budget_bytes == budget
        rows = _rows(folder / f"{stem}.pareto.csv")
        assert rows and all(r["plan"].startswith(f"{stem}-pareto/") for r in rows)
        assert all(is_plan_file(folder / r["plan"]) for r in rows)
    capsys.readouterr()
    # an agoq plan at --out is replaced, and said so, naming the files beside it that go with it
    assert _search(profile_dir, small, high, "--front-budgets", "2") == 0
    err = capsys.readouterr().err
    assert "replacing the plan" in err and "small.pareto.csv" in err and "small-pareto/" in err
    assert load_plan(small).budget_bytes == high
    assert {k: v for k, v in _digest(folder).items() if k.startswith("large")} == \
        {k: v for k, v in after.items() if k.startswith("large")}


def test_the_dashboard_reads_a_search_named_after_its_plan(profile_dir, tmp_path):
    """The dashboard finds a folder holding PLAN.pareto.csv and PLAN.study.db as a search and reads the front and
    the study the search wrote (the rows of the CSV, read here independently)."""
    from dashboard.discovery import Folder, scan
    from dashboard.searches import read_pareto, study_file

    low, high = _bounds(profile_dir)
    folder = tmp_path / "root" / "s"
    out = folder / "mine.json"
    assert _search(profile_dir, out, (low + high) // 2, "--front-budgets", "3", "--method", "both",
                   "--trials", "2") == 0
    root = (tmp_path / "root").resolve()
    index = scan(root)
    assert "s" in index.items["searches"]
    found = Folder(folder.resolve(), root)
    read = read_pareto(found)
    rows = _rows(folder / "mine.pareto.csv")
    assert [r["plan"] for r in read["rows"]] == [r["plan"] for r in rows]
    assert [r["predicted_peak_bytes"] for r in read["rows"]] == [int(r["predicted_peak_bytes"]) for r in rows]
    assert study_file(found).name == "mine.study.db"


def test_notes_are_summed_up_unless_verbose(profile_dir, tmp_path, capsys):
    """By default the cost model's notes are one line that counts them; --verbose prints each; the plan file keeps
    every one either way."""
    low, high = _bounds(profile_dir)
    budget = low + (high - low) // 3
    quiet, loud = tmp_path / "quiet.json", tmp_path / "loud.json"
    assert _search(profile_dir, loud, budget, "--front-budgets", "0", "--verbose", "--error-cap", "recipe") == 0
    printed = [line.strip()[len("note: "):] for line in capsys.readouterr().err.splitlines()
               if line.strip().startswith("note: ")]
    assert printed, "a search from the synthetic profile has notes to print"
    assert set(printed) <= set(load_plan(loud).source.notes)
    assert _search(profile_dir, quiet, budget, "--front-budgets", "0", "--error-cap", "recipe") == 0
    err = capsys.readouterr().err
    assert not any(line.strip().startswith("note: ") for line in err.splitlines())
    summary = [line for line in err.splitlines() if "--verbose" in line]
    assert len(summary) == 1 and f"{len(printed)} note{'s' if len(printed) > 1 else ''} " in summary[0]
    assert set(printed) <= set(load_plan(quiet).source.notes)


@pytest.mark.parametrize("flags", [["--host-budget", "1GB"], ["--offload", "on"], ["--offload", "off"]])
def test_asking_for_offload_without_a_host_link_says_why(profile_dir, tmp_path, capsys, flags):
    """A profile without timing.host_link (this synthetic one, as every CPU profile) cannot price offload: a search
    that asks for it says so on stderr and in the plan's notes, and gives the plan it gives without the flags."""
    assert "host_link" not in (json.loads((profile_dir / "profile.json").read_text()).get("timing") or {})
    low, high = _bounds(profile_dir)
    budget = (low + high) // 2
    plain, asked = tmp_path / "plain.json", tmp_path / "asked.json"
    assert _search(profile_dir, plain, budget, "--front-budgets", "0") == 0
    assert "host link" not in capsys.readouterr().err
    assert _search(profile_dir, asked, budget, "--front-budgets", "0", *flags) == 0
    err = capsys.readouterr().err
    said = [n for n in load_plan(asked).source.notes if "did not measure the host link (timing.host_link)" in n]
    assert len(said) == 1 and said[0] in err and "agoq profile" in said[0]
    assert not any("host link" in n for n in load_plan(plain).source.notes)
    a, b = load_plan(plain), load_plan(asked)
    assert a.predicted.step_seconds == b.predicted.step_seconds and not b.offload_layers()


def test_a_front_that_cannot_be_made_leaves_the_plan_and_says_so(profile_dir, tmp_path, capsys, monkeypatch):
    """Where the front's range cannot be found (agoq.search.pareto raises ValueError), the search still writes the
    plan it found, the same as without a front, and says why there is no front (printed, and in the plan's notes)."""
    import agoq.search.search as search_module

    low, high = _bounds(profile_dir)
    budget = (low + high) // 2
    alone = tmp_path / "alone.json"
    assert _search(profile_dir, alone, budget, "--front-budgets", "0") == 0

    def no_front(*args, **kwargs):
        raise ValueError("no choice meets the time cap at any budget")

    monkeypatch.setattr(search_module, "memory_error_front", no_front)
    out = tmp_path / "plan.json"
    capsys.readouterr()
    assert _search(profile_dir, out, budget, "--front-budgets", "4") == 0
    err = capsys.readouterr().err
    said = [n for n in load_plan(out).source.notes if n.startswith("no memory/error Pareto front")]
    assert len(said) == 1 and said[0] in err and "no choice meets the time cap" in said[0]
    assert load_plan(out).predicted.step_seconds == load_plan(alone).predicted.step_seconds
    assert _rows(tmp_path / "plan.pareto.csv") == []
