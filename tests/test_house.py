"""The code's house rules, read from the source (nothing is imported): no module under agoq/ or dashboard/ over
MAX_LINES lines, no import circle among them, and the stages' boundaries.

Imports are found with `ast`, wherever they stand: at the top of a module, inside a function (an import that runs
late still joins the two modules) or under `if TYPE_CHECKING`; `importlib.import_module("a.b")` with a literal name
counts too. Each resolves to the module it names: `import a.b.c` and `from a.b import c` to a.b.c where that is a
module (a package's __init__.py is the module a.b), else to the longest dotted prefix that is one; `from . import x`
and `from ..a import x` from the importing module's package. Only agoq's and dashboard's own modules count.
A package is not counted as imported by its submodules' importers (importing a.b.c runs a/__init__.py and
a/b/__init__.py first, but a package's __init__ importing its own submodules is no circle to undo). Names given
to importlib as non-literal strings are not seen: the lazy exports (agoq.lazy) and agoq.cli's table of subcommands,
which names dashboard.command, the one way the agoq command reaches the dashboard (`agoq dashboard`).

The checkers are tested on small trees written here, so that each can be seen to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agoq", "dashboard")
MAX_LINES = 450

# Files still over MAX_LINES, each with why; being split. A file listed here that is no longer over fails the test:
# take it off the list.
ALLOWED: dict = {}  # {path: why it may be longer for now}: none is

STAGES = ("agoq.profiler", "agoq.search", "agoq.train")
COMMAND_LINE = ("agoq.commands", "agoq.cli")

# (importer, imported) pairs that break a boundary rule on purpose, each with why. One no longer found fails the
# test: take it off the list.
BOUNDARY_EXCEPTIONS = {
    ("agoq.train.__main__", "agoq.commands.train"):
        "`python -m agoq.train` (how torchrun starts training on every rank) is `agoq train` itself: an entry point "
        "of the command line, not the train stage's code",
    ("agoq.train.__main__", "agoq.commands.arguments"):
        "`python -m agoq.train` reports bad arguments as every command does (agoq.commands.arguments.run_module)",
    ("dashboard.command", "agoq.commands.arguments"):
        "`agoq dashboard`'s subcommand module (agoq.cli dispatches to it) takes the command line's argparse types; "
        "the dashboard's pages and service import no command",
}


# -- reading the tree ---------------------------------------------------------------------------------------------

def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> its file (relative to `root`), for every .py file under `packages`."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path.relative_to(root)
    return out


def _known(name: str | None, known: dict) -> str | None:
    """The longest dotted prefix of `name` that is one of `known`'s modules (None: none is)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: dict[str, Path], root: Path) -> dict[str, int]:
    """The modules of `known` that `module` (its file `path`) imports -> the line of the first such import."""
    tree = ast.parse((root / path).read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name, line):
        if name is not None and name != module:
            found.setdefault(name, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, known), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base_parts = parts[:len(parts) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else _known(base, known), node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                add(_known(node.args[0].value, known), node.lineno)
    return found


def import_graph(root: Path = ROOT, packages=PACKAGES) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    known = modules(root, packages)
    return {m: imports_of(m, path, known, root) for m, path in known.items()}, known


# -- the checks ---------------------------------------------------------------------------------------------------

def long_files(root: Path = ROOT, packages=PACKAGES, limit: int = MAX_LINES) -> dict[str, int]:
    """'package/.../file.py' -> its line count, for every file over `limit` lines."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            count = len(path.read_text().splitlines())
            if count > limit:
                out[path.relative_to(root).as_posix()] = count
    return out


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One import circle [m0, m1, ..., m0] per strongly connected group of modules (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            step = next(targets, None)
            if step is not None:
                if step not in graph:
                    continue
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(set(group))
    return [_cycle_in(group, graph) for group in groups]


def _cycle_in(group: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest circle through the group's first module (breadth first, within the group)."""
    first = min(group)
    came_from = {first: None}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == first:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if target in group and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {first} in {sorted(group)}")  # a group of two or more always has one


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def boundary_breaks(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> the rule it breaks: a stage (profiler, search, train) imports another stage or the
    command line (agoq.commands, agoq.cli); the dashboard imports the command line; agoq imports the dashboard."""
    out = {}
    for module, targets in graph.items():
        for target in targets:
            stage = next((s for s in STAGES if _under(module, s)), None)
            if stage is not None:
                other = next((s for s in STAGES + COMMAND_LINE if s != stage and _under(target, s)), None)
                if other is not None:
                    out[(module, target)] = f"the stage {stage} imports {other}"
            if _under(module, "dashboard") and any(_under(target, c) for c in COMMAND_LINE):
                out[(module, target)] = "the dashboard imports the command line"
            if _under(module, "agoq") and _under(target, "dashboard"):
                out[(module, target)] = "agoq imports the dashboard"
    return out


def _describe(cycle: list[str], graph: dict[str, dict[str, int]], files: dict[str, Path]) -> str:
    steps = [f"{files[a].as_posix()}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(steps + [files[cycle[-1]].as_posix()])


# -- the rules, on this tree ----------------------------------------------------------------------------------------

def test_no_file_over_the_limit():
    over = long_files()
    unexplained = {path: n for path, n in over.items() if path not in ALLOWED}
    assert not unexplained, (f"over {MAX_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in unexplained.items())
                             + ": split them by idea (agoq/search/milp_rows.py, milp_model.py show how)")
    shrunk = sorted(path for path in ALLOWED if path not in over)
    assert not shrunk, f"no longer over {MAX_LINES} lines (or gone): take {shrunk} off ALLOWED in {__file__}"


def test_no_import_circle():
    graph, files = import_graph()
    found = circles(graph)
    assert not found, "import circles (file:line of each import):\n" + "\n".join(
        _describe(c, graph, files) for c in found)


def test_stage_boundaries():
    graph, files = import_graph()
    breaks = boundary_breaks(graph)
    new = {pair: rule for pair, rule in breaks.items() if pair not in BOUNDARY_EXCEPTIONS}
    assert not new, "boundaries crossed:\n" + "\n".join(
        f"{files[a].as_posix()}:{graph[a][b]} imports {b}: {rule}" for (a, b), rule in sorted(new.items()))
    stale = sorted(pair for pair in BOUNDARY_EXCEPTIONS if pair not in breaks)
    assert not stale, f"no longer imported: take {stale} off BOUNDARY_EXCEPTIONS in {__file__}"


# -- the checkers, on small trees ------------------------------------------------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    root = _tree(tmp_path, {
        "agoq/__init__.py": "",
        "agoq/search/__init__.py": "from agoq.search import milp\n",  # a package importing its own: no circle
        "agoq/search/milp.py": "import numpy\nfrom . import rows\n",
        "agoq/search/rows.py": "from ..units import MIB\n",
        "agoq/units.py": "def f():\n    from agoq.search.milp import x\n",
        "agoq/lone.py": "import agoq.units\n",
    })
    graph, files = import_graph(root, ("agoq",))
    assert graph["agoq.search.rows"] == {"agoq.units": 1} and graph["agoq.units"] == {"agoq.search.milp": 2}
    assert graph["agoq.search"] == {"agoq.search.milp": 1}
    (cycle,) = circles(graph)
    assert cycle == ["agoq.search.milp", "agoq.search.rows", "agoq.units", "agoq.search.milp"]
    assert _describe(cycle, graph, files) == \
        "agoq/search/milp.py:2 -> agoq/search/rows.py:1 -> agoq/units.py:2 -> agoq/search/milp.py"
    (root / "agoq/units.py").write_text("MIB = 2 ** 20\n")
    assert circles(import_graph(root, ("agoq",))[0]) == []


def test_importlib_with_a_literal_name_and_two_separate_circles(tmp_path):
    root = _tree(tmp_path, {
        "agoq/__init__.py": "import importlib\nX = importlib.import_module('agoq.b.c')\n",
        "agoq/b/__init__.py": "", "agoq/b/c.py": "import agoq\n",
        "dashboard/__init__.py": "", "dashboard/p.py": "from dashboard import q\n",
        "dashboard/q.py": "import dashboard.p\n",
    })
    graph, _ = import_graph(root)
    assert sorted(circles(graph)) == [["agoq", "agoq.b.c", "agoq"], ["dashboard.p", "dashboard.q", "dashboard.p"]]


def test_boundary_breaks_are_named(tmp_path):
    root = _tree(tmp_path, {
        "agoq/__init__.py": "", "agoq/cli.py": "", "agoq/commands/__init__.py": "", "agoq/commands/search.py": "",
        "agoq/profiler/__init__.py": "", "agoq/profiler/run.py": "from agoq.units import MIB\n",
        "agoq/search/__init__.py": "", "agoq/search/cost.py": "def f():\n    from agoq.profiler import run\n",
        "agoq/train/__init__.py": "", "agoq/train/loop.py": "import agoq.cli\n", "agoq/units.py": "",
        "agoq/formats.py": "from dashboard.pages import page\n",
        "dashboard/__init__.py": "",
        "dashboard/pages.py": "from agoq.commands import search\nimport agoq.search.cost\n",
    })
    graph, _ = import_graph(root)
    assert boundary_breaks(graph) == {
        ("agoq.search.cost", "agoq.profiler.run"): "the stage agoq.search imports agoq.profiler",
        ("agoq.train.loop", "agoq.cli"): "the stage agoq.train imports agoq.cli",
        ("agoq.formats", "dashboard.pages"): "agoq imports the dashboard",
        ("dashboard.pages", "agoq.commands.search"): "the dashboard imports the command line",
    }


@pytest.mark.parametrize("lines", [MAX_LINES, MAX_LINES + 1])
def test_long_files_counts_lines(tmp_path, lines):
    root = _tree(tmp_path, {"agoq/a.py": "x = 1\n" * lines, "agoq/b.py": "", "other/c.py": "x = 1\n" * 999})
    assert long_files(root, ("agoq",)) == ({} if lines <= MAX_LINES else {"agoq/a.py": lines})
