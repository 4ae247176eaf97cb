"""The one schema reader of agoq's JSON files (docs/formats.md): every file carries `"schema": "agoq.<kind>/<N>"`
(or `<N>.<minor>`), and a reader refuses another kind, or a major version newer than it reads, with an error that
names the file and the field. Light: it imports nothing but agoq.files, so that any reader (the dashboard too) may
use it without loading agoq's kernels."""

from __future__ import annotations

import os
import re
from pathlib import Path

from agoq.files import read_json_object

_SCHEMA = re.compile(r"([a-z_.]+)/(\d+)((?:\.\d+)*)")


class FormatError(ValueError):
    """A file that exists (or should) but cannot be read as the format it should have; the message names the file
    and the field that was wrong, and what to do."""


def check_schema(data: dict, kind: str, major: int, where: str) -> tuple[int, int]:
    """(major, minor) of `data`'s `schema`, which must be "<kind>/<N>[.<minor>...]" (kind e.g. "agoq.plan") with N
    no newer than `major`, the newest this agoq reads; FormatError naming `where` (the file) and the field
    otherwise."""
    expected = f"{kind}/{major}"
    schema = data.get("schema")
    if schema is None:
        raise FormatError(f"{where}: schema: missing (expected {expected!r})")
    m = _SCHEMA.fullmatch(schema) if isinstance(schema, str) else None
    if m is None or m.group(1) != kind:
        raise FormatError(f"{where}: schema: {schema!r} is not a {kind.split('.')[-1]} schema (expected {expected!r})")
    found = int(m.group(2))
    if found > major:
        raise FormatError(f"{where}: schema: {schema!r} is newer than this agoq reads ({expected}): upgrade agoq")
    minor = m.group(3).split(".")[1:]
    return found, int(minor[0]) if minor else 0


def read_versioned(path: str | os.PathLike, kind: str, major: int, where: str | None = None) -> dict:
    """The JSON object in `path` (agoq.files.read_json_object: at most MAX_JSON_BYTES, refused unread above) with
    its schema checked (`check_schema`). Every problem, a missing or unreadable file included, is a FormatError
    that names the file as `where` gives it (default: its path)."""
    p = Path(path)
    where = str(p) if where is None else where
    what = f"{kind.split('.')[-1]} file"
    try:
        data = read_json_object(p, what, name=where)
    except FileNotFoundError:
        raise FormatError(f"{where}: missing (no such file)") from None
    except OSError as e:
        raise FormatError(f"{where}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise FormatError(str(e)) from None
    check_schema(data, kind, major, where)
    return data
