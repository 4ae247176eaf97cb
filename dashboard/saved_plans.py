"""Plans the dashboard saves (`POST /api/plan/save`): the one place it writes. A file goes to
ROOT/plans/NAME.json, NAME a plain file name, written atomically, and an existing file is replaced only
when asked to."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any

from agoq.files import write_json
from agoq.units import excerpt

FOLDER = "plans"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


class Exists(Exception):
    """The file is there already and the request did not ask to replace it."""


def safe_name(name: Any) -> str:
    """`name` as a file name of its own (letters, digits, '.', '_', '-'; no folders, not hidden), with
    .json added when missing; ValueError saying what is allowed otherwise."""
    text = str(name or "").strip()
    if not isinstance(name, str) or not NAME.fullmatch(text) or ".." in text:
        raise ValueError(f"name: {excerpt(name)} is not a plain file name: use letters, digits, '.', '_' and '-' (at most "
                         "96, starting with a letter or digit, no folders), e.g. plan-30GiB.json")
    return text if text.endswith(".json") else text + ".json"


def plans_folder(root: Path) -> Path:
    """ROOT/plans, refused when it is there but not a plain folder inside the root (a link leading elsewhere)."""
    folder = Path(root) / FOLDER
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ValueError(f"{folder} is not a plain folder of the root: plans are saved only into ROOT/{FOLDER}/")
    return folder


def save_plan(root: Path, name: Any, plan: dict[str, Any], overwrite: bool = False) -> Path:
    """Write `plan` as ROOT/plans/NAME (JSON, as `agoq search` writes a plan) atomically; Exists when the
    file is there and `overwrite` is false (the check and the write are one step: a file appearing meanwhile
    is not replaced either). Returns the path."""
    folder = plans_folder(root)
    target = folder / safe_name(name)
    if overwrite:
        return write_json(target, plan)
    temporary = write_json(folder / f".{target.name}.{secrets.token_hex(6)}.saving", plan)
    try:
        os.link(temporary, target)  # fails when the name is taken: never replaces a file
    except FileExistsError:
        raise Exists(f"{FOLDER}/{target.name} exists already: choose another name or say overwrite") from None
    finally:
        temporary.unlink()
    return target
