"""The profile's layout steps (profile.json `layout_steps`, docs/formats.md; profile schema 1.1): a real training
step of each data-parallel layout, every rank of the profile's world running it, at the profile's micro-batch and
sequence length, which the search calibrates each layout's exposed communication and per-rank peak on
(agoq.search.layout_calibration).

A profile of one rank (world_size 1) holds fsdp rows only: one-rank FSDP2, FSDP2 in a group of one process, which
moves nothing between ranks, so its step less the one-process compute is FSDP2's own cost (the copies in and out of
every unit's all-gather and reduce-scatter, its hooks, the int8/int4 weight gathers' quantize and dequantize
kernels); a what-if re-targeted from that profile carries it into its fsdp prices (agoq.search.whatif). A replicated
row at world_size 1 is refused (DDP of one process is no DDP).

    {"version": 1, "world_size": N, "rows": [
     {"layout": "replicated" | "fsdp",               how the ranks keep the state (agoq.vocabulary.LAYOUTS)
      "gradients": "bf16" | "quangrad8" | "sdp4bit", the gradient storage and collective (as the layout allows)
      "weight_gather": "bf16" | "int8" | "int4",     FSDP2's weight all-gather (`agoq train --weight-gather`); bf16
                                                     for the other layouts
      "compile": "eager" | "compiled", "policy": "bf16", "micro_batch": m, "grad_accum": 1,
      "optimizer": "adamw8bit", "master": "fp32",     the knobs of the step (every layer kept whole)
      "warmup_steps": w, "steps": n,                  steps run before the measured ones, steps measured
      "step_seconds": s,                              the median of the measured steps' seconds on each rank, the
                                                      largest over ranks
      "peak_bytes": p | null,                         the largest torch.cuda.max_memory_allocated of any step (the
                                                      warm-up included) on any rank; null off the GPU
      "seconds_per_step": [...],                      rank 0's seconds of every step run (warm-up included)
      "source": "profile"}]}

`layout_rows(header)` returns the checked rows ([] for a profile without the section: older profiles, and one-GPU
profiles made before one-rank FSDP2 was measured, stay readable); a row of agoq's retired own sharded layout
("sharded", measured by profiles before it was retired) is skipped, as a layout the search no longer prices.
`section(rows, world_size)` builds the section.
"""

from __future__ import annotations

from typing import Any, Optional

from agoq.vocabulary import (COMPILE_MODES, GRADIENT_MODES, LAYOUT_GRADIENTS, LAYOUTS, MASTERS, OPTIMIZERS, SHARDED,
                             WEIGHT_GATHERS)

VERSIONS = (1,)
ONE_RANK_LAYOUT = "fsdp"  # the layout a profile of one rank measures (one-rank FSDP2)
KEY_FIELDS = ("layout", "gradients", "weight_gather", "compile", "micro_batch", "grad_accum", "optimizer", "master")


def row_key(row: dict) -> tuple:
    """The configuration a row measured (its KEY_FIELDS, in order)."""
    return tuple(row.get(k) for k in KEY_FIELDS)


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_row(row: Any, where: str) -> dict:
    """A row with its fields checked; ValueError naming the field otherwise."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a layout step is an object, got {type(row).__name__}")
    out = dict(row)
    out.setdefault("weight_gather", "bf16")
    out.setdefault("policy", "bf16")
    choices = {"layout": LAYOUTS, "gradients": GRADIENT_MODES, "weight_gather": WEIGHT_GATHERS,
               "compile": COMPILE_MODES, "optimizer": OPTIMIZERS, "master": MASTERS, "policy": ("bf16",)}
    for name, allowed in choices.items():
        if out.get(name) not in allowed:
            raise ValueError(f"{where}.{name}: must be one of {', '.join(allowed)}, got {out.get(name)!r}")
    if out["gradients"] not in LAYOUT_GRADIENTS[out["layout"]]:
        raise ValueError(f"{where}.gradients: layout {out['layout']} runs {', '.join(LAYOUT_GRADIENTS[out['layout']])}"
                         f", not {out['gradients']}")
    if out["weight_gather"] != "bf16" and out["layout"] != "fsdp":
        raise ValueError(f"{where}.weight_gather: only an fsdp step gathers its weights ({out['weight_gather']} given "
                         f"for {out['layout']})")
    for name in ("micro_batch", "grad_accum", "steps"):
        if not _is_int(out.get(name), 1):
            raise ValueError(f"{where}.{name}: must be an integer >= 1, got {out.get(name)!r}")
    if not _is_int(out.get("warmup_steps", 0), 0):
        raise ValueError(f"{where}.warmup_steps: must be an integer >= 0, got {out.get('warmup_steps')!r}")
    seconds = out.get("step_seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"{where}.step_seconds: must be a number > 0, got {seconds!r}")
    peak = out.get("peak_bytes")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak < 0):
        raise ValueError(f"{where}.peak_bytes: must be bytes >= 0 or null, got {peak!r}")
    return out


def layout_rows(header: dict, where: str = "profile.json") -> list[dict]:
    """The checked rows of a profile header's `layout_steps` ([] where it has none); a later row of the same
    configuration replaces an earlier one. ValueError naming the field for a malformed section."""
    section_ = header.get("layout_steps")
    if section_ is None:
        return []
    if not isinstance(section_, dict) or not isinstance(section_.get("rows"), list):
        raise ValueError(f"{where}: layout_steps: expected {{'version': 1, 'world_size': N, 'rows': [...]}}")
    if section_.get("version", 1) not in VERSIONS:
        raise ValueError(f"{where}: layout_steps.version {section_.get('version')!r} is newer than this agoq reads "
                         f"({', '.join(map(str, VERSIONS))}): upgrade agoq, or profile again with this one")
    world = section_.get("world_size")
    if not _is_int(world, 1):
        raise ValueError(f"{where}: layout_steps.world_size: must be an integer >= 1, got {world!r}")
    rows: dict[tuple, dict] = {}
    for i, row in enumerate(section_["rows"]):
        if isinstance(row, dict) and row.get("layout") == SHARDED:
            continue  # the retired own sharded step: nothing prices it any more
        checked = check_world(check_row(row, f"{where}: layout_steps.rows[{i}]"), world,
                              f"{where}: layout_steps.rows[{i}]")
        rows[row_key(checked)] = checked
    return list(rows.values())


def check_world(row: dict, world_size: int, where: str) -> dict:
    """`row` where a world of `world_size` ranks measures its layout (one rank: fsdp only, one-rank FSDP2);
    ValueError naming the layout otherwise."""
    if world_size == 1 and row["layout"] != ONE_RANK_LAYOUT:
        raise ValueError(f"{where}.layout: a layout step of one rank is one-rank FSDP2 ({ONE_RANK_LAYOUT}), got "
                         f"{row['layout']} (its data parallelism needs several ranks)")
    return row


def section(rows: list[dict], world_size: int) -> dict:
    """The `layout_steps` section holding `rows` (each checked), measured over `world_size` ranks (1: fsdp rows
    only)."""
    return {"version": VERSIONS[-1], "world_size": int(world_size),
            "rows": [check_world(check_row(r, f"layout_steps.rows[{i}]"), int(world_size), f"layout_steps.rows[{i}]")
                     for i, r in enumerate(rows)]}


def find(rows: list[dict], **key: Optional[Any]) -> Optional[dict]:
    """The row measuring exactly `key` (every KEY_FIELDS given; weight_gather defaults to bf16)."""
    key.setdefault("weight_gather", "bf16")
    want = tuple(key.get(k) for k in KEY_FIELDS)
    return next((r for r in rows if row_key(r) == want), None)


__all__ = ["layout_rows", "section", "check_row", "check_world", "ONE_RANK_LAYOUT", "row_key", "find", "KEY_FIELDS",
           "VERSIONS"]
