"""Write a benchmark's figures to experiments/results/NAME.json with what produced them."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch

from agoq.environment import hardware, software_versions
from agoq.files import write_json

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
    """Machine and software facts recorded beside every result (agoq.environment's, plus the CUDA build)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hw = hardware(device, torch.cuda.device_count() if device == "cuda" else 1)
    sw = software_versions()
    return {"torch": sw["torch"], "cuda": torch.version.cuda, "python": sw["python"],
            "gpu": hw["name"] if device == "cuda" else None, "gpu_count": torch.cuda.device_count(),
            "gpu_memory_bytes": hw["memory_bytes"], "triton": sw["triton"], "agoq": sw["agoq"]}


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
        path = write_json(folder / f"{name}.json", record)
        written = written or path
    return written
