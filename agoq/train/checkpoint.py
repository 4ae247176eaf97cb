"""Checkpoints written per rank with torch.distributed.checkpoint (DCP), that a kill at any moment cannot spoil.

Layout (docs/formats.md, "Run", format agoq.checkpoint/2):

    RUN_DIR/checkpoints/latest.json          {"schema": "agoq.checkpoint/2", "step": 120, "folder": "step-00000120"}
    RUN_DIR/checkpoints/step-00000120/       one DCP checkpoint: .metadata, one __<rank>_*.distcp per writing
                                             rank, and agoq.json (schema, step, world, what a resume checks)
    RUN_DIR/checkpoints/.step-00000140.tmp/  a save in progress

A save: every rank writes its part of the state dict into the `.tmp` folder (`dcp.save`: tensors every rank
holds alike are written once, a rank's own pieces by that rank), rank 0 then writes agoq.json there, renames
the folder to `step-N`, points latest.json at it (written atomically: agoq.files) and only then deletes the
older step folder. A kill at any point leaves latest.json naming a complete folder; `clean_partial` removes
what the kill left behind. A checkpoint written by N processes loads into M (DCP reshards); the trainer
decides which layouts may change.

Format 1 (`RUN_DIR/checkpoint/`, one torch.save file per rank) is not read: resuming one says so.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from agoq.files import write_json
from agoq.vocabulary import SHARDED, SHARDED_RETIRED

SCHEMA = "agoq.checkpoint/2"
FOLDER = "checkpoints"
LATEST = "latest.json"
INFO = "agoq.json"
OLD_FOLDER = "checkpoint"  # format 1's


def _step_folder(step: int) -> str:
    return f"step-{step:08d}"


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _read(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _refuse_old_format(run_dir: Path) -> None:
    old = _read(run_dir / OLD_FOLDER / "state.json")
    if old is not None and str(old.get("schema", "")).startswith("agoq.checkpoint/"):
        raise ValueError(f"{run_dir / OLD_FOLDER} holds a checkpoint of format {old.get('schema')} (one torch.save "
                         f"file per rank); this agoq reads {SCHEMA} only. Resume it with the agoq that wrote it "
                         "(format 1: agoq before the torch.distributed.checkpoint checkpoints), or start a new run "
                         "with another --out")


def find_checkpoint(run_dir: str | Path) -> tuple[Path, dict] | None:
    """(folder, agoq.json) of the checkpoint latest.json names, or None when the run has none yet.

    Raises ValueError for a checkpoint of another format (saying which agoq reads it) and for a latest.json
    whose folder is missing or incomplete (which agoq never leaves behind)."""
    run_dir = Path(run_dir)
    latest = _read(run_dir / FOLDER / LATEST)
    if latest is None:
        _refuse_old_format(run_dir)
        return None
    if latest.get("schema") != SCHEMA:
        raise ValueError(f"{run_dir / FOLDER / LATEST} is of format {latest.get('schema')!r}; this agoq reads "
                         f"{SCHEMA}: resume it with the agoq that wrote it, or start a new run with another --out")
    folder = run_dir / FOLDER / str(latest.get("folder"))
    info = _read(folder / INFO)
    if info is None or info.get("schema") != SCHEMA or not (folder / ".metadata").is_file():
        raise ValueError(f"{run_dir / FOLDER / LATEST} names {folder}, which is missing or incomplete: the run "
                         "folder was changed by hand. Point latest.json at a complete step folder, or start a new "
                         "run with another --out")
    return folder, info


def clean_partial(run_dir: str | Path) -> None:
    """Remove what an interrupted save left (call on one rank, before training): `.tmp` folders and step
    folders other than the one latest.json names."""
    root = Path(run_dir) / FOLDER
    if not root.is_dir():
        return
    latest = _read(root / LATEST)
    keep = str(latest.get("folder")) if latest else None
    for folder in root.iterdir():
        if folder.is_dir() and folder.name != keep and (folder.name.startswith("step-")
                                                        or folder.name.startswith(".step-")):
            shutil.rmtree(folder)


def save_checkpoint(run_dir: str | Path, step: int, state_dict: dict[str, Any], info: dict[str, Any], *,
                    rank: int, world: int, barrier: Callable[[], None]) -> None:
    """Save `state_dict` (a DCP state dict: tensors, DTensors, picklable values) for `step`;
    every rank calls it with its own. Rank 0 records `info` (JSON) beside it and makes it the latest."""
    root = Path(run_dir) / FOLDER
    tmp = root / f".{_step_folder(step)}.tmp"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    with warnings.catch_warnings():  # one process: DCP says it saves without a process group, as asked
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=_no_dist())
    barrier()
    folder = root / _step_folder(step)
    if rank == 0:
        write_json(tmp / INFO, {"schema": SCHEMA, "step": step, "world": world, **info})
        previous = _read(root / LATEST)
        copy = 1
        while folder.exists():  # the same step saved again: never replace the folder latest.json may name
            folder, copy = root / f"{_step_folder(step)}-{copy}", copy + 1
        tmp.rename(folder)
        write_json(root / LATEST, {"schema": SCHEMA, "step": step, "folder": folder.name})
        if previous and previous.get("folder") != folder.name and (root / str(previous.get("folder"))).is_dir():
            shutil.rmtree(root / str(previous["folder"]))
    barrier()


def refuse_retired(found: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    """`found` (`find_checkpoint`'s folder and agoq.json) as it is, unless it is a checkpoint of agoq's retired own
    sharded mode (parallel "sharded": SDP4Bit's flat shards, which no run reads any more): ValueError saying what
    to run instead."""
    folder, info = found
    if info.get("parallel") == SHARDED:
        raise ValueError(f"the checkpoint in {folder} was written by --parallel sharded and does not resume: "
                         f"{SHARDED_RETIRED}; start a fresh run (another --out)")
    return found


def saved_keys(folder: Path) -> set[str]:
    """The flattened keys ("model.lm_head.weight", ...) a checkpoint folder holds."""
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def load_checkpoint(folder: Path, state_dict: dict[str, Any]) -> None:
    """Fill `state_dict` (built like the saved one, for this rank's layout) from `folder`: tensors in place,
    other values replaced. Every rank calls it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        try:
            dcp.load(state_dict, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=_no_dist())
        except (CheckpointException, RuntimeError, ValueError) as e:
            detail = " ".join(str(e).split())[:400]
            raise ValueError(f"the checkpoint in {folder} does not fit this run's model and optimizer ({detail}): "
                             "resume with the model and optimizer settings that wrote it") from e


__all__ = ["SCHEMA", "find_checkpoint", "clean_partial", "save_checkpoint", "load_checkpoint", "saved_keys",
           "refuse_retired"]
