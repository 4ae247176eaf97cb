"""What `agoq demo` wrote in its --out folder, recorded in OUT/agoq-demo.json, so that `agoq demo --force` replaces
exactly that and nothing a user put there.

The demo writes into parts of OUT, each a folder it creates: profile/, search/, search-one-process/, runs/baseline/,
runs/plan/ and examples/NAME/ (`is_demo_part`). Before a part is written the record claims it (the folder does not
exist then, so whatever appears in it comes from the demo), with the folders above it that the demo creates (runs/,
examples/); once the part is written, or its stage has failed, the record lists what the part holds. The record is
rewritten atomically (agoq.files) at each of these moments, so a demo stopped at any point leaves a record of
everything it wrote so far; a part whose writer was killed before its listing holds only what that writer wrote,
and is taken whole.

Format agoq.demo/1 (docs/formats.md):

  {"schema": "agoq.demo/1", "updated": "2026-11-28T20:41:44+00:00", "finished": true,
   "parts": {"profile": {"created": [], "entries": {"profile.json": "file", "journal": "dir", ...}},
             "runs/plan": {"created": ["runs"], "entries": null}, ...}}

`entries`: every path under the part (relative to it, "/"-separated) as "dir", "file" or "link"; null while the part
is being written. Before a demo writes, `inspect` sorts what is in its way into an earlier demo's parts (every entry
recorded) and foreign paths (anything the record does not list), and `remove` deletes the former, entry by entry.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional

from agoq.files import entries_under, read_json_object, write_json

RECORD = "agoq-demo.json"
SCHEMA = "agoq.demo/1"
FIXED_PARTS = ("profile", "search", "search-one-process", "runs/baseline", "runs/plan")
KINDS = ("dir", "file", "link")
NAMED = 8  # foreign paths named in a refusal; the rest are counted


def is_demo_part(part: str) -> bool:
    """Whether `part` (a path relative to OUT) is a folder agoq demo writes: one of FIXED_PARTS or examples/NAME."""
    bits = PurePosixPath(part).parts
    return part in FIXED_PARTS or (len(bits) == 2 and bits[0] == "examples" and _relative(part))


def _relative(path) -> bool:
    """A relative "/"-separated path that stays below its folder (no "..", ".", empty or absolute parts)."""
    if not isinstance(path, str) or not path or "\\" in path or path.startswith("/"):
        return False
    return all(bit not in ("", ".", "..") for bit in path.split("/"))


class NotARecord(ValueError):
    """OUT/agoq-demo.json is there but is no record that agoq demo wrote (or it was changed by hand)."""


def read_record(out: Path) -> Optional[dict]:
    """The record in `out` ({part: {"created": [...], "entries": {...} | None}}), None when there is none; raises
    NotARecord, saying what is wrong, when the file is not one agoq demo wrote."""
    path = out / RECORD
    if not os.path.lexists(path):
        return None
    try:
        data = read_json_object(path, "agoq demo's record")
    except (ValueError, FileNotFoundError) as e:
        raise NotARecord(str(e)) from None
    parts = data.get("parts")
    if data.get("schema") != SCHEMA or not isinstance(parts, dict):
        raise NotARecord(f"{path} is not agoq demo's record (schema {SCHEMA} with its parts)")
    for part, claim in parts.items():
        entries = claim.get("entries") if isinstance(claim, dict) else None
        created = claim.get("created") if isinstance(claim, dict) else None
        if (not is_demo_part(part) or not isinstance(created, list) or not all(map(_relative, created))
                or not (entries is None or (isinstance(entries, dict) and all(map(_relative, entries))
                                            and all(kind in KINDS for kind in entries.values())))):
            raise NotARecord(f"{path}: part {part!r} is not as agoq demo records its parts")
    return parts


class DemoRecord:
    """The record of one demo's writing, kept in OUT/agoq-demo.json (see the module docstring)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.parts: dict[str, dict] = {}
        self.finished = False

    def save(self) -> None:
        write_json(self.out / RECORD, {"schema": SCHEMA, "updated": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "finished": self.finished, "parts": self.parts})

    @contextlib.contextmanager
    def writing(self, part: str) -> Iterator[Path]:
        """Claim `part` (recorded before it is written), yield its folder, then record what it holds, whether the
        writing succeeded or not. The folder must not exist yet: the demo writes only folders it creates."""
        if not is_demo_part(part):
            raise ValueError(f"{part!r} is not a part agoq demo writes")
        target = self.out / part
        if os.path.lexists(target):
            raise ValueError(f"{target} exists: agoq demo writes only folders it creates (remove it first)")
        bits = PurePosixPath(part).parts
        above = [PurePosixPath(*bits[:i]).as_posix() for i in range(1, len(bits))]
        self.parts[part] = {"created": [a for a in above if not os.path.lexists(self.out / a)], "entries": None}
        self.save()
        try:
            yield target
        finally:
            self.parts[part]["entries"] = entries_under(target)
            self.save()

    def finish(self) -> None:
        self.finished = True
        self.save()


@dataclass
class InTheWay:
    """What lies where a demo writes: `earlier`, parts an earlier demo wrote, everything in them recorded;
    `foreign`, paths (relative to OUT; a folder stands for what it holds) that no demo recorded writing; `record`,
    the earlier demo's record (None: there is none)."""

    earlier: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    record: Optional[dict] = None

    def named(self) -> str:
        """The foreign paths, at most NAMED of them named and the rest counted."""
        shown = ", ".join(self.foreign[:NAMED])
        more = len(self.foreign) - NAMED
        return shown + (f" and {more} more" if more > 0 else "")


def _collapsed(paths: list[str], kinds: dict[str, str]) -> list[str]:
    """`paths`, less those inside another of them that is a folder; folders written with a trailing "/"."""
    folders = {p for p in paths if kinds.get(p) == "dir"}
    kept = [p for p in sorted(paths) if not any(p.startswith(f + "/") for f in folders)]
    return [p + "/" if p in folders else p for p in kept]


def inspect(out: Path, parts: list[str]) -> InTheWay:
    """Sort what lies in `out` where a demo writing `parts` (and the parts the earlier demo recorded) would write.
    Raises NotARecord when OUT/agoq-demo.json is not a demo's record."""
    record = read_record(out)
    found = InTheWay(record=record)
    recorded = record or {}
    for part in sorted(set(parts) | set(recorded)):
        bits = PurePosixPath(part).parts
        above = next((PurePosixPath(*bits[:i]).as_posix() for i in range(1, len(bits))
                      if os.path.lexists(out.joinpath(*bits[:i])) and (out.joinpath(*bits[:i]).is_symlink()
                                                                      or not out.joinpath(*bits[:i]).is_dir())), None)
        if above is not None:  # a file or a link where the demo makes a folder
            found.foreign.append(above)
            continue
        target = out / part
        if not os.path.lexists(target):
            continue
        claim = recorded.get(part)
        plain_folder = target.is_dir() and not target.is_symlink()
        if claim is None or not plain_folder:
            found.foreign.append(part + "/" if plain_folder else part)
            continue
        found.earlier.append(part)
        if claim["entries"] is None:  # its writer was cut off before listing it: all in it is the demo's
            continue
        now = entries_under(target)
        extra = [p for p, kind in now.items() if claim["entries"].get(p) != kind]
        found.foreign += [f"{part}/{p}" for p in _collapsed(extra, now)]
    found.foreign = sorted(set(found.foreign))
    return found


def remove(out: Path, found: InTheWay) -> None:
    """Delete the earlier demo's parts `found` (inspected just before, with nothing foreign in them): each recorded
    entry, deepest first, then the part's folder and the folders above it that the demo created, where empty."""
    recorded = found.record or {}
    for part in found.earlier:
        target, entries = out / part, recorded[part]["entries"]
        if entries is None:
            shutil.rmtree(target)
            continue
        for path in sorted(entries, key=lambda p: p.count("/"), reverse=True):
            where = target / path
            if entries[path] == "dir" and where.is_dir() and not where.is_symlink():
                where.rmdir()
            elif entries[path] != "dir" and os.path.lexists(where):
                where.unlink()
        target.rmdir()
    created = {c for claim in recorded.values() for c in claim["created"]}
    for folder in sorted(created, key=lambda p: p.count("/"), reverse=True):
        with contextlib.suppress(OSError):  # gone already, or holding what a user put there since: kept
            (out / folder).rmdir()


__all__ = ["RECORD", "SCHEMA", "DemoRecord", "InTheWay", "NotARecord", "inspect", "is_demo_part", "read_record",
           "remove"]
