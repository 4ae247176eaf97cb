"""`agoq demo --force` replaces exactly what an earlier demo wrote (its record, OUT/agoq-demo.json) and nothing a user
put in --out; a folder holding what no demo wrote is refused, naming it, with or without --force; a demo stopped
partway (a failed stage, or a kill) leaves a record that --force can act on.

The stages are stand-ins that write random files (fresh names and contents on every call) where the real stage
writes, so the test knows independently what the demo wrote; the GPU comparison is skipped (test_demo.py runs it).
The record of the real stages' files is checked in tests/test_without_triton.py's demo run."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from agoq.cli import main
from agoq.commands import demo, demo_folder


class FakeStages:
    """Stand-ins for the demo's stage commands: each writes a few random files (some in a sub-folder) into the
    folder its command would write, and remembers every path it wrote (relative to OUT). `fail_at` names a stage
    (by its folder) that fails after writing; `on_write(part)` is called once a stage has written."""

    def __init__(self, out: Path, rng: random.Random, fail_at: str | None = None, on_write=None):
        self.out, self.rng, self.fail_at, self.on_write = out, rng, fail_at, on_write
        self.written: set[str] = set()

    def _write(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        rel = path.relative_to(self.out)
        self.written |= {rel.as_posix()} | {p.as_posix() for p in rel.parents if p != Path(".")}

    def __call__(self, argv: list[str]) -> None:
        target = Path(argv[argv.index("--out") + 1])
        folder = target.parent if target.suffix == ".json" else target
        part = folder.relative_to(self.out).as_posix()
        if argv[0] == "profile":
            steps = [{"policy": "bf16", "predicted_peak_bytes": 9_000_001},
                     {"policy": "agoq-paper", "predicted_peak_bytes": 4_000_003}]
            self._write(folder / "profile.json", json.dumps({"memory": {"steps": steps}}))
        if argv[0] == "search":
            self._write(target, json.dumps({"training": {"seq_len": 16, "micro_batch": 1}}))
        for _ in range(self.rng.randrange(1, 4)):
            name = f"f{self.rng.randrange(10**9)}"
            sub = folder / f"d{self.rng.randrange(10**9)}" if self.rng.random() < 0.5 else folder
            self._write(sub / name, str(self.rng.random()))
        if self.on_write:
            self.on_write(part)
        if part == self.fail_at:
            raise demo.StageFailed(f"stand-in failure in {part}")


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes, by path relative to it."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _shipped(out: Path) -> set[str]:
    """The paths the demo's copy of the shipped example profiles makes under `out` (folders included)."""
    from agoq.examples import profiles

    paths = {"examples"}
    for name, source in profiles().items():
        paths |= {f"examples/{name}"} | {f"examples/{name}/{p.relative_to(source).as_posix()}"
                                         for p in source.rglob("*")}
    return paths


def _recorded(out: Path) -> set[str]:
    """The paths the record lists (each part and everything under it), relative to `out`."""
    parts = json.loads((out / demo_folder.RECORD).read_text())["parts"]
    return {*parts, *(c for claim in parts.values() for c in claim["created"]),
            *(f"{part}/{p}" for part, claim in parts.items() for p in claim["entries"] or {})}


@pytest.fixture()
def stages(monkeypatch, tmp_path, seed):
    """A function that runs `agoq demo ARGS` into tmp_path/out with fresh stand-in stages; returns (exit code,
    the stand-ins)."""
    monkeypatch.setattr(demo, "gpu_comparison", lambda: [])
    rng = random.Random(seed)
    out = tmp_path / "out"

    def run(*args, **fake_kw):
        fake = FakeStages(out, rng, **fake_kw)
        monkeypatch.setattr(demo, "_stage", fake)
        return main(["demo", "--out", str(out), "--steps", "2", *args]), fake
    return out, run


def _user_files(out: Path, rng: random.Random) -> dict[str, bytes]:
    """Put a user's files in `out` beside (not inside) the demo's folders: a note, a run of theirs next to the
    demo's runs, a plan the dashboard saved; returns them as _files reads them."""
    mine = {"notes.txt": str(rng.random()), f"runs/mine-{rng.randrange(999)}/metrics.jsonl": str(rng.random()),
            "plans/saved.json": str(rng.random()), "examples/README": str(rng.random())}
    for rel, text in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    return {rel: text.encode() for rel, text in mine.items()}


def test_force_replaces_exactly_what_the_demo_wrote(stages, seed, capsys):
    out, run = stages
    code, first = run()
    assert code == 0
    written = first.written | _shipped(out)
    assert _recorded(out) == written  # the record lists what the stages and the copy wrote, nothing else
    everything = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert everything == written | {demo_folder.RECORD}
    mine = _user_files(out, random.Random(seed + 1))
    before = _files(out)

    assert run()[0] == 2  # without --force: refused, naming the earlier demo, nothing touched
    err = capsys.readouterr().err
    assert "earlier demo" in err and "--force" in err and _files(out) == before

    code, second = run("--force")
    assert code == 0
    after = _files(out)
    assert {rel: after.get(rel) for rel in mine} == mine  # the user's files survive, unchanged
    gone = first.written - second.written  # the first demo's files of random names
    assert gone and not any((out / p).exists() for p in gone)
    assert all((out / p).exists() for p in second.written)
    assert set(after) == {p for p in (second.written | _shipped(out)) if (out / p).is_file()} | set(mine) | {
        demo_folder.RECORD}


def test_a_folder_holding_what_no_demo_wrote_is_refused_by_name(stages, seed, capsys):
    out, run = stages
    assert run()[0] == 0
    rng = random.Random(seed)
    inside = sorted(p for p in _recorded(out) if (out / p).is_dir() and p != "examples" and p != "runs")
    stray = f"{rng.choice(inside)}/stray-{rng.randrange(10**6)}.txt"  # a file put inside a demo's folder
    extra = f"runs/plan/extra-{rng.randrange(10**6)}"                   # a folder of the user's inside one
    (out / stray).write_text("mine")
    (out / extra).mkdir()
    (out / extra / "a.txt").write_text("mine too")
    (out / "search-one-process").mkdir()                                # a folder the demo writes, not its own
    before = _files(out)
    for force in ([], ["--force"]):
        assert run(*force)[0] == 2
        err = capsys.readouterr().err
        assert stray in err and f"{extra}/" in err and "search-one-process/" in err, err
        assert f"{extra}/a.txt" not in err  # a foreign folder is named, not everything in it
        assert "earlier demo" not in err and "Traceback" not in err
        assert _files(out) == before


def test_results_of_the_quick_start_are_not_a_demo(stages, capsys):
    """README's GPU quick start keeps its results in work/profile, work/search and work/runs: no record, so neither
    `agoq demo --out work` nor `--force` touches them, and the refusal does not call them an earlier demo."""
    out, run = stages
    for rel in ("profile/profile.json", "search/plan.json", "runs/plan/run.json", "runs/other/run.json"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(rel)
    before = _files(out)
    for force in ([], ["--force"]):
        assert run(*force)[0] == 2
        err = capsys.readouterr().err
        assert "profile/" in err and "search/" in err and "runs/plan/" in err and "runs/other" not in err, err
        assert "earlier demo" not in err and "no demo record" in err
        assert _files(out) == before


def test_a_record_that_is_not_a_demos_is_refused(stages, capsys):
    out, run = stages
    out.mkdir()
    (out / demo_folder.RECORD).write_text(json.dumps({"schema": "agoq.demo/1", "parts": {"../elsewhere": {
        "created": [], "entries": None}}}))
    assert run("--force")[0] == 2
    assert demo_folder.RECORD in capsys.readouterr().err
    assert (out / demo_folder.RECORD).exists()


@pytest.mark.parametrize("how", ["failed", "killed"])
def test_a_demo_stopped_partway_can_be_replaced(stages, seed, how, capsys):
    """A stage that fails leaves the record listing what it wrote; a kill while a stage writes leaves the record as
    it was then (that stage's folder claimed, not yet listed): either way --force replaces the lot."""
    out, run = stages
    parts = ["profile", "search", "runs/baseline", "runs/plan"]
    where = random.Random(seed).choice(parts)
    snapshot = {}

    def keep_record(part):  # what a kill at this moment would leave behind
        if part == where:
            snapshot["record"] = (out / demo_folder.RECORD).read_text()

    code, first = run(fail_at=where if how == "failed" else None, on_write=keep_record)
    assert code == (1 if how == "failed" else 0)
    if how == "killed":
        (out / demo_folder.RECORD).write_text(snapshot["record"])
        stopped = parts.index(where) + 1
        for part in parts[stopped:]:  # the killed demo never wrote the later parts, nor copied the examples
            shutil.rmtree(out / part)
        shutil.rmtree(out / "examples")
        assert json.loads(snapshot["record"])["parts"][where]["entries"] is None
    mine = _user_files(out, random.Random(seed + 2))
    capsys.readouterr()
    assert run()[0] == 2 and "earlier demo" in capsys.readouterr().err
    code, second = run("--force")
    assert code == 0
    assert not any((out / p).exists() for p in first.written - second.written)
    after = _files(out)
    assert {rel: after.get(rel) for rel in mine} == mine


def test_entries_under_lists_without_following_links(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    (tmp_path / "g").write_text("y")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "secret").write_text("z")
    os.symlink(outside, tmp_path / "link")
    from agoq.files import entries_under

    assert entries_under(tmp_path) == {"a": "dir", "a/b": "dir", "a/b/f": "file", "g": "file", "link": "link"}
    assert entries_under(tmp_path / "g") == {} and entries_under(tmp_path / "link") == {}
