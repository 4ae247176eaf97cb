"""Writing files so that a crash never leaves a half-written one in place of a good one."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write text or bytes to `path` via a temporary file in the same folder and an atomic rename."""
    payload = data.encode() if isinstance(data, str) else data

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(payload)

    return write_with(path, write)


def json_safe(value: Any) -> Any:
    """`value` made safe for strict JSON: NaN and infinities become None, tuples lists, keys strings, and
    numpy scalars and arrays plain numbers and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return json_safe(value.tolist())
    return value


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write `obj` as indented JSON (with a final newline)."""
    return write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_with(path: str | os.PathLike, writer: Callable[[str], None]) -> Path:
    """Atomically produce `path` with `writer(tmp_path)`, for writers that want a file name
    (pandas.to_parquet, torch.save)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:  # say which file, not the temporary one, and what to do
        raise ValueError(f"cannot write {target}: {e.strerror or e}; give a path in a folder you can write "
                         "to") from None
    os.close(fd)
    try:
        writer(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a file agoq writes gets the usual mode
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def check_output_folder(path: str | os.PathLike, what: str) -> Path:
    """Make sure a command can write into folder `path` before it does any work, leaving nothing behind: the
    folder, or the nearest of its parents that exists (where the command will create it), must be a folder in
    which a temporary file can be made (it is removed at once). Raises ValueError naming `what` (e.g. "--out")
    when `path` is a file, lies under a file, or cannot be created or written to. Several processes may check
    one folder at once."""
    folder = Path(path)
    full = folder.absolute()
    existing = next(p for p in (full, *full.parents) if os.path.exists(p) or p == p.parent)
    if not existing.is_dir():
        where = "is" if existing == full else f"lies under {existing}, which is"
        raise ValueError(f"{what} {folder} {where} a file, not a folder: give a folder path")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".agoq-write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        inside = "" if existing == full else f" (it would be created in {existing})"
        raise ValueError(f"{what} {folder}: cannot write there{inside}: {e.strerror or e}; give a folder you can "
                         "write to") from None
    return folder


def check_output_file(path: str | os.PathLike, what: str) -> Path:
    """Make sure a command can (atomically) write file `path` before it does any work: it must not be a folder,
    and its folder must be writable (`check_output_folder`). Raises ValueError naming `what`."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{what} {target} is a folder: give a file path")
    check_output_folder(target.parent, f"{what} {target}: its folder")
    return target


MAX_JSON_BYTES = 64 * 2**20  # the largest JSON file agoq reads; its own are far smaller (a plan of 80 layers: ~100 KiB)


def read_json_object(path: str | os.PathLike, what: str, max_bytes: int | None = None,
                     name: str | None = None) -> dict:
    """The JSON object in `path`; FileNotFoundError / ValueError that name `what` (e.g. "plan file") and the file
    (as `name` gives it, by default its path) and say what is wrong with it. A file over `max_bytes` (default
    MAX_JSON_BYTES) is refused from its size alone, unread, so that a stray huge file cannot take a reader's
    memory."""
    p = Path(path)
    shown = f"{what} {p if name is None else name}"
    if p.is_dir():
        raise ValueError(f"{shown} is a folder: give the file")
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p if name is None else name}")
    limit = MAX_JSON_BYTES if max_bytes is None else max_bytes
    size = p.stat().st_size
    if size > limit:
        raise ValueError(f"{shown} is {size / 2**20:.1f} MiB, larger than the {limit / 2**20:.0f} MiB agoq reads "
                         "for one JSON file (its own are far smaller); not read: give the file agoq wrote")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{shown} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{shown} must hold a JSON object, got {type(data).__name__}")
    return data


def entries_under(folder: str | os.PathLike) -> dict[str, str]:
    """What lies under `folder`, as {path relative to it (with "/"): "dir" | "file" | "link"}, `folder` itself left
    out; symbolic links are listed as "link" and not followed. {} when `folder` is not a folder."""
    root = Path(folder)
    if root.is_symlink() or not root.is_dir():
        return {}
    found: dict[str, str] = {}
    for here, dirs, files in os.walk(root):
        base = Path(here).relative_to(root)
        for name in dirs:
            path = Path(here) / name
            found[(base / name).as_posix()] = "link" if path.is_symlink() else "dir"
        for name in files:
            found[(base / name).as_posix()] = "link" if (Path(here) / name).is_symlink() else "file"
    return dict(sorted(found.items()))
