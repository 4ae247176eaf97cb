"""README.md and docs/*.md: relative links resolve (files and heading anchors), every `agoq` command line and
flag they mention exists in the CLI's parsers, and the README stays short and gives CI's two set-up commands
verbatim, each on a line of its own (as .ci/run checks)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from agoq.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 100  # lines, exclusive: the README stays a summary; detail goes to docs/

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`(?:[^`\n]|\n(?!\n))+`")  # a code span may wrap, within a paragraph
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
FLAGS_OF_OTHER_PROGRAMS = {"--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint"}  # torchrun's


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks), with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    """Link targets outside code (code blocks and inline code spans are not links), except URLs."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_link(source: Path, target: str, root: Path = ROOT) -> str | None:
    """Why `target`, linked from `source`, does not resolve inside `root`, or None when it does."""
    file_part, _, anchor = target.partition("#")
    dest = (source.parent / file_part).resolve() if file_part else source
    if not dest.exists():
        return f"{target}: no such file {dest}"
    if root not in dest.parents and dest != root:
        return f"{target}: outside the repository"
    if anchor:
        if dest.suffix != ".md":
            return f"{target}: an anchor into a file that is not Markdown"
        if anchor not in anchors(dest):
            return f"{target}: {dest.relative_to(root)} has no heading with anchor #{anchor}"
    return None


@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_relative_links_resolve(path):
    links = relative_links(path)
    problems = [why for t in links if (why := broken_link(path, t))]
    assert not problems, f"{_id(path)}: broken links:\n" + "\n".join(problems)


def test_link_checker_catches_what_it_must(tmp_path):
    """The checker itself: a missing file, a missing anchor and a link inside code are told apart."""
    tmp_path = tmp_path.resolve()
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title\n## Plan: `plan.json`, written by `agoq search` (and `agoq profile --budget`)\n"
                                   "## Title\n")
    doc.write_text("[x](b.md#title-1) [y](b.md#plan-planjson-written-by-agoq-search-and-agoq-profile---budget)\n"
                   "[z](missing.md) [w](b.md#nothing) `[v](inside-code.md)`\n```\n[u](in-block.md)\n```\n")
    targets = relative_links(doc)
    assert targets == ["b.md#title-1", "b.md#plan-planjson-written-by-agoq-search-and-agoq-profile---budget",
                       "missing.md", "b.md#nothing"]
    assert [broken_link(doc, t, tmp_path) is None for t in targets] == [True, True, False, False]
    assert broken_link(doc, "../outside.md", tmp_path) is not None


def _parsers() -> dict[str, set[str]]:
    """Each agoq subcommand's option strings."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


def command_lines(path: Path) -> list[str]:
    """Lines of code (in blocks or inline spans) that run an agoq command, after any VAR=value: `agoq SUB ...`,
    `python -m agoq.train ...` or `torchrun ... -m agoq.train ...`; a comment after '#' is dropped."""
    text = path.read_text()
    pieces = [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]
    pieces += [" ".join(span.strip("`").split()) for span in INLINE_CODE.findall(FENCE.sub("", text))]
    found = []
    for piece in pieces:
        code = re.sub(r"\s#\s.*$", "", piece)
        m = re.match(r"\s*(?:[A-Z_]+=\S+\s+)*((?:agoq [a-z]+|python -m agoq\.train|torchrun .*?-m agoq\.train)\b.*)", code)
        if m:
            found.append(m.group(1))
    return found


def unknown_flags(line: str, parsers: dict[str, set[str]]) -> tuple[str, list[str]]:
    """The subcommand a command line runs and the flags in it that subcommand does not have."""
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    if "agoq.train" in line:
        sub = "train"
    else:
        sub = words[1]
        if sub not in parsers:
            return sub, [f"(no subcommand {sub!r})"]
    flags = [w.split("=", 1)[0] for w in words if FLAG.fullmatch(w.split("=", 1)[0])]
    return sub, [f for f in flags if f not in parsers[sub] | FLAGS_OF_OTHER_PROGRAMS]


@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_agoq_command_lines_use_existing_flags(path):
    parsers = _parsers()
    problems = []
    for line in command_lines(path):
        sub, bad = unknown_flags(line, parsers)
        if bad:
            problems.append(f"{line!r}: agoq {sub} has no {', '.join(bad)}")
    assert not problems, f"{_id(path)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", [p for p in DOCS if p.name != "results.md"], ids=_id)
def test_every_flag_mentioned_exists_somewhere(path):
    """Outside results.md (whose commands run experiment scripts), every --flag in code names an option of
    some agoq subcommand."""
    known = set().union(*_parsers().values()) | FLAGS_OF_OTHER_PROGRAMS | {"--help", "--version"}
    text = path.read_text()
    code = "\n".join(FENCE.findall(text) + INLINE_CODE.findall(FENCE.sub("", text)))
    unknown = sorted({f for f in FLAG.findall(code) if f not in known})
    assert not unknown, f"{_id(path)} mentions flags no agoq command has: {unknown}"


def test_flag_checker_catches_what_it_must():
    parsers = _parsers()
    assert unknown_flags("agoq search --profile p --budget 1GB --out x --budgett 2", parsers) == ("search", ["--budgett"])
    assert unknown_flags("torchrun --nproc-per-node 2 -m agoq.train probe --parallel ddp --plan p.json", parsers) \
        == ("train", [])
    assert unknown_flags("agoq train probe --budget 3GB", parsers) == ("train", ["--budget"])
    assert unknown_flags("agoq serve --root x", parsers)[1] == ["(no subcommand 'serve')"]


def _ci_commands() -> list[str]:
    """The set-up commands .ci/run requires README.md to hold, read from the script itself."""
    script = (ROOT / ".ci" / "run").read_text()
    commands = [shlex.split(m)[0] for m in re.findall(r"^(?:FIRST|TESTS)=(.*)$", script, re.M)]
    assert len(commands) == 2, "expected FIRST= and TESTS= in .ci/run"
    return commands


def test_readme_is_short_and_gives_the_set_up_commands_verbatim():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"
    for command in _ci_commands():
        assert command in lines, f"README.md no longer gives, on a line of its own: {command}"
