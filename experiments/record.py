"""Write a benchmark's figures to experiments/results/NAME.json with what produced them."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _git_commit() -> str:
    if os.environ.get("AGOQ_COMMIT"):  # machines that get the tree without .git are told the commit
        return os.environ["AGOQ_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """Machine and software facts recorded beside every result."""
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def write_result(name: str, figures: dict, out_dir: str | os.PathLike | None = None) -> Path:
    """Atomically write {figures, command, commit, environment, date} as NAME.json; returns the path."""
    record = {
        "name": name,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(),
        "figures": figures,
    }
    paths = [RESULTS]
    if out_dir:
        paths.append(Path(out_dir))
    written = None
    for folder in paths:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(tmp, folder / f"{name}.json")
        written = written or folder / f"{name}.json"
    return written
