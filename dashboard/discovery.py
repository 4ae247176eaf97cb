"""Finding agoq's outputs under a root folder: profiles, searches (Pareto fronts and Optuna studies),
plans and runs, each named by its path relative to the root.

The catalog never follows a path out of the root: directory symlinks are not descended into, file
symlinks are kept only when they resolve inside the root, and a request's id is only ever looked up
in the catalog, never joined onto the root. Symlinks left out because they lead outside the root (or
nowhere) are listed in the index's problems, so that nothing vanishes unexplained.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agoq.formats.views import FormatError

KINDS = ("profiles", "searches", "plans", "runs")
SKIP_DIRS = {"checkpoint", "checkpoints", "__pycache__", "node_modules"}
PLAN_MARK = b'"agoq.plan/'
STUDY_FILES = ("study.db", "study.journal")
# a search names its files after its plan: PLAN_STEM.pareto.csv, PLAN_STEM.study.db (earlier: pareto.csv, study.db)
SEARCH_SUFFIXES = (".pareto.csv", ".study.db", ".study.journal")
MIN_RESCAN = 0.5  # seconds between two forced rescans


@dataclass(frozen=True)
class Artifact:
    """One thing found under the root: `kind` (profiles, searches, plans, runs), `id` (its path
    relative to the root, '/'-separated; '.' for the root itself) and its absolute `path` (a folder,
    or for plans a file)."""

    kind: str
    id: str
    path: Path


@dataclass(frozen=True)
class Folder:
    """An artifact's folder under a root; every file is reached through `file(name)`, which refuses
    names that are not plain file names and symlinks that lead out of the root."""

    path: Path
    root: Path

    def file(self, name: str) -> Path:
        """`path / name` (which may not exist); FormatError when `name` is not a plain file name or
        the file is a symlink resolving outside the root."""
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise FormatError(f"{name!r} is not a plain file name")
        path = self.path / name
        if os.path.lexists(path) and not inside(self.root, path):
            raise FormatError(f"{name}: a symlink leading outside the root (or a broken one); not read")
        return path


@dataclass
class Index:
    """Everything found by one scan, by kind and id, with the time of the scan (seconds since the
    epoch) and the scan's problems (paths skipped and why)."""

    items: dict[str, dict[str, Artifact]] = field(default_factory=lambda: {k: {} for k in KINDS})
    scanned_at: float = 0.0
    problems: list[str] = field(default_factory=list)


def inside(root: Path, path: Path) -> bool:
    """Whether `path`, with every symlink resolved, lies inside `root` (itself resolved)."""
    try:
        path.resolve(strict=True).relative_to(root)
        return True
    except (OSError, ValueError, RuntimeError):
        return False


def outside_link_note(root: Path, path: Path, folder: bool) -> str:
    """Why the symlink `path` under `root` is not read: it leads outside the root, or nowhere."""
    what = "folder" if folder else "file"
    if not os.path.exists(path):
        return f"{_relative_id(root, path)}: a broken symlink, skipped"
    return (f"{_relative_id(root, path)}: a symlink to a {what} outside the root, not read (the dashboard reads "
            "only under --root: copy it in, or give a --root that holds it)")


def _relative_id(root: Path, path: Path) -> str:
    rel = path.relative_to(root).as_posix()
    return rel or "."


def _looks_like_plan(path: Path, seen: dict[str, tuple[tuple[int, int], bool]]) -> bool:
    """Whether a JSON file is a plan (plan.json, or "agoq.plan/" in its first 4 KiB); the answer is
    remembered in `seen` until the file changes, so rescans do not reread every JSON file."""
    if path.name == "plan.json":
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (st.st_mtime_ns, st.st_size)
    known = seen.get(str(path))
    if known is not None and known[0] == key:
        return known[1]
    try:
        with open(path, "rb") as f:
            answer = PLAN_MARK in f.read(4096)
    except OSError:
        answer = False
    seen[str(path)] = (key, answer)
    return answer


def scan(root: Path, max_depth: int = 8, seen: dict | None = None) -> Index:
    """Walk `root` (already resolved) and index every profile folder (profile.json), run folder
    (run.json), search folder (pareto.csv or an Optuna study.db / study.journal, or those named after a plan:
    PLAN_STEM.pareto.csv, PLAN_STEM.study.db / .study.journal) and plan file
    (plan.json, or any JSON file whose schema is agoq.plan/N). Hidden folders, checkpoints and
    anything deeper than `max_depth` are skipped; so is every symlink leading out of `root` (or nowhere), noted
    in the index's problems. `seen` remembers which JSON files are plans between scans."""
    index = Index(scanned_at=time.time())
    seen = {} if seen is None else seen
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=None):
        here = Path(dirpath)
        depth = len(here.relative_to(root).parts)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
        if depth >= max_depth:
            dirnames[:] = []
        for d in [d for d in dirnames if (here / d).is_symlink()]:  # its target, when inside, is walked itself
            dirnames.remove(d)
            if not inside(root, here / d):
                index.problems.append(outside_link_note(root, here / d, folder=True))
        names = set(filenames)
        usable = set()
        for name in sorted(names):
            p = here / name
            if p.is_symlink() and not inside(root, p):
                index.problems.append(outside_link_note(root, p, folder=False))
                continue
            usable.add(name)
        folder_id = _relative_id(root, here)
        if "profile.json" in usable:
            index.items["profiles"][folder_id] = Artifact("profiles", folder_id, here)
        if "run.json" in usable:
            index.items["runs"][folder_id] = Artifact("runs", folder_id, here)
        if "pareto.csv" in usable or any(s in usable for s in STUDY_FILES) \
                or any(n.endswith(SEARCH_SUFFIXES) for n in usable):
            index.items["searches"][folder_id] = Artifact("searches", folder_id, here)
        for name in sorted(usable):
            if name.endswith(".json") and name not in ("profile.json", "run.json") and not name.startswith("."):
                p = here / name
                if _looks_like_plan(p, seen):
                    plan_id = _relative_id(root, p)
                    index.items["plans"][plan_id] = Artifact("plans", plan_id, p)
    return index


class Catalog:
    """The index of a root folder, rescanned when a request asks for it and the last scan is older
    than `ttl` seconds (so new runs show up while the dashboard is running, and a burst of requests
    costs one scan)."""

    def __init__(self, root: str | os.PathLike, ttl: float = 2.0):
        resolved = Path(root).resolve()
        if not resolved.is_dir():
            raise FileNotFoundError(f"--root {root}: no such folder; give the folder that holds your profiles, "
                                    "searches and runs (e.g. the one `agoq demo` printed)")
        self.root = resolved
        self.ttl = ttl
        self._index = Index()
        self._plan_marks: dict = {}
        self._lock = threading.Lock()

    def index(self, refresh: bool = False) -> Index:
        """The current index; rescans first when the last scan is older than ttl, or when `refresh`
        is set and the last scan is older than MIN_RESCAN seconds (so a stream of requests for
        unknown ids cannot keep the server walking the folder)."""
        with self._lock:
            age = time.time() - self._index.scanned_at
            if age > self.ttl or (refresh and age > MIN_RESCAN):
                self._index = scan(self.root, seen=self._plan_marks)
            return self._index

    def outdated(self) -> None:
        """Mark the index out of date, so the next request rescans (after the dashboard wrote a file)."""
        with self._lock:
            self._index = Index(items=self._index.items, scanned_at=0.0, problems=self._index.problems)

    def get(self, kind: str, artifact_id: str) -> Artifact:
        """The artifact of `kind` named `artifact_id`; KeyError when there is none. The id is only
        compared with the ids found by the scan, and the found path is checked to still lie inside
        the root, so no request can reach a file outside it."""
        if kind not in KINDS:
            raise KeyError(kind)
        found = self.index().items[kind].get(artifact_id)
        if found is None:
            found = self.index(refresh=True).items[kind].get(artifact_id)
        if found is None or not inside(self.root, found.path):
            raise KeyError(artifact_id)
        return found

    def folder(self, artifact: Artifact) -> Folder:
        """The guarded folder of a folder artifact (profiles, searches, runs)."""
        return Folder(artifact.path, self.root)
