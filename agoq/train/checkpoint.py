"""Checkpoints that a kill at any moment cannot spoil: written to a temporary folder, then swapped in.

`RUN_DIR/checkpoint/` holds `state.json` (step, world, settings that must match on resume) and one
`rank{r}.pt` per rank (its model part, optimizer state including quantized moments, master weights,
RNG states). Every rank writes its file into `RUN_DIR/.checkpoint-<step>.tmp/`; once all have, rank 0
writes `state.json` there last (the folder is complete exactly when it has one), renames the current
checkpoint to `.checkpoint-old`, renames the new folder to `checkpoint` and deletes the old one. A kill
between the two renames leaves a complete `.checkpoint-old` (and a complete new folder): `find_checkpoint`
takes the newest complete folder, so a half-written checkpoint never replaces a good one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from agoq.files import write_json, write_with

SCHEMA = "agoq.checkpoint/1"
CURRENT = "checkpoint"
OLD = ".checkpoint-old"


def _complete(folder: Path) -> dict | None:
    """state.json of a complete checkpoint folder, or None."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if state.get("schema") != SCHEMA:
        return None
    if not all((folder / f"rank{r}.pt").is_file() for r in range(int(state.get("world", 0)))):
        return None
    return state


def find_checkpoint(run_dir: str | Path) -> tuple[Path, dict] | None:
    """(folder, state) of the newest complete checkpoint under `run_dir`, or None when there is none."""
    run_dir = Path(run_dir)
    found = []
    for folder in [run_dir / CURRENT, run_dir / OLD, *sorted(run_dir.glob(".checkpoint-*.tmp"))]:
        state = _complete(folder) if folder.is_dir() else None
        if state is not None:
            found.append((int(state["step"]), folder.name == CURRENT, folder, state))
    if not found:
        return None
    _, _, folder, state = max(found, key=lambda t: (t[0], t[1]))
    return folder, state


def clean_partial(run_dir: str | Path) -> None:
    """Remove leftovers of an interrupted save (call on one rank, before training, after `find_checkpoint`)."""
    run_dir = Path(run_dir)
    best = find_checkpoint(run_dir)
    if best is not None and best[0].name != CURRENT:  # killed between the renames: promote the newest one
        if (run_dir / CURRENT).exists():
            shutil.rmtree(run_dir / CURRENT)
        best[0].rename(run_dir / CURRENT)
    for folder in [run_dir / OLD, *run_dir.glob(".checkpoint-*.tmp")]:
        if folder.exists():
            shutil.rmtree(folder)


def save_checkpoint(run_dir: str | Path, step: int, rank: int, world: int, payload: dict[str, Any],
                    state: dict[str, Any], barrier: Callable[[], None]) -> Path:
    """Save this rank's `payload` for `step`; every rank calls it. Rank 0 writes `state` and swaps folders.

    `barrier` synchronises the ranks (a no-op in one process). Returns the checkpoint folder.
    """
    run_dir = Path(run_dir)
    tmp = run_dir / f".checkpoint-{step}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    write_with(tmp / f"rank{rank}.pt", lambda path: torch.save(payload, path))
    barrier()
    if rank == 0:
        write_json(tmp / "state.json", {"schema": SCHEMA, "step": step, "world": world, **state})
        current, old = run_dir / CURRENT, run_dir / OLD
        if old.exists():
            shutil.rmtree(old)
        if current.exists():
            current.rename(old)
        tmp.rename(current)
        if old.exists():
            shutil.rmtree(old)
    barrier()
    return run_dir / CURRENT


def load_rank_payload(folder: Path, rank: int, device: torch.device | str) -> dict[str, Any]:
    """This rank's saved payload, tensors on `device`."""
    return torch.load(folder / f"rank{rank}.pt", map_location=device, weights_only=False)
