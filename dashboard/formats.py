"""Reading agoq's files as docs/formats.md defines them, read-only, with errors that say which file
and which field was wrong (the pages show them as messages)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from agoq import units

SUPPORTED = {"profile": 1, "plan": 1, "run": 1}


class BrokenFile(ValueError):
    """A file that exists but cannot be read as the format it should have."""


MAX_JSON_BYTES = 64 * 2**20  # the largest JSON file read; agoq's own are far smaller (a plan of 80 layers: ~100 KiB)


def read_json(path: Path, kind: str) -> dict[str, Any]:
    """Parse `path` and check that its `schema` is agoq.<kind>/N with N no newer than this dashboard
    reads; raises BrokenFile naming the file and the problem (also for a file over MAX_JSON_BYTES, which
    is skipped unread so that a stray huge file cannot take the server's memory)."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise BrokenFile(f"{path.name}: {size / 2**20:.0f} MiB, larger than the {MAX_JSON_BYTES // 2**20} MiB "
                             "this dashboard reads for one JSON file; skipped")
        data = json.loads(path.read_text())
    except OSError as e:
        raise BrokenFile(f"{path.name}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BrokenFile(f"{path.name}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BrokenFile(f"{path.name}: expected a JSON object, found {type(data).__name__}")
    schema = data.get("schema")
    prefix = f"agoq.{kind}/"
    if not isinstance(schema, str) or not schema.startswith(prefix):
        raise BrokenFile(f"{path.name}: field 'schema' is {schema!r}, expected '{prefix}{SUPPORTED[kind]}'")
    try:
        major = int(schema[len(prefix):].split(".")[0])
    except ValueError:
        raise BrokenFile(f"{path.name}: field 'schema' {schema!r} has no version number") from None
    if major > SUPPORTED[kind]:
        raise BrokenFile(f"{path.name}: field 'schema' is {schema!r}, newer than this dashboard reads "
                         f"({prefix}{SUPPORTED[kind]}); upgrade agoq")
    return data


def number(value: Any) -> float | None:
    """A finite float from a JSON/CSV value, or None."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def format_bytes(n: Any) -> str:
    """Bytes in binary units with two decimals ('3.21 MiB'), or an en dash when unknown."""
    return units.format_bytes(n, digits=2)
