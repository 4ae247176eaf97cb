"""The profile's measured steps (profile.json `measured_steps`, docs/formats.md): whole training steps, each run by
agoq's training code at one knob combination, with its step time and peak memory.

A row:

    {"compile": "eager" | "compiled",              how the decoder layers ran (compiled: torch.compile per layer)
     "policy": "bf16" | "agoq-paper" | "checkpoint-all",   every layer kept whole / the published LAAQ recipe /
                                                    every layer checkpointed
     "activation_memory_budget": null | B,          torch.compile's partitioner budget (compiled bf16 only)
     "micro_batch": m, "grad_accum": a,             sequences per micro-batch, micro-batches per optimizer step
     "gradients": "bf16" | "quangrad8", "optimizer": "adamw" | "adamw8bit", "master": "fp32" | "none",
     "steps": n,                                    steps measured (the first included)
     "step_seconds": s,                             median seconds of the steps after warm-up
     "peak_bytes": p,                               the largest torch.cuda.max_memory_allocated of any step, the
                                                    first included (null off the GPU)
     "first_step_peak_bytes": p1, "source": "profile" | "run" | "older profile section",
     "repeat_step_seconds": [s, ...], "repeat_peak_bytes": [p, ...]   optional: each pass's median and largest
                                                    step peak where the kind was measured in several passes
     "offload_layers": K, "offloaded_bytes": B}     optional (section version 2): the first K decoder layers' saved
                                                    tensors were kept in host memory (agoq.runtime.activations.offload), B
                                                    bytes of them per micro-batch; absent: nothing offloaded

`measured_rows(header)` returns the rows of a profile header: its `measured_steps`, and for profiles written before
that section existed, the same facts read from the sections that held them (the eager memory steps, and the
`compiled` section's steps, smaller micro-batches and activation_memory_budget points), so one reader serves every
profile. Older sections measured a fwd + bwd and an optimizer step in a loop of their own, with the profile's
optimizer, bf16 gradients and one micro-batch per step; their rows say so in `source`.
"""

from __future__ import annotations

from typing import Any, Optional

from agoq.vocabulary import COMPILE_MODES, MASTERS, OPTIMIZERS, REPLICA_GRADIENT_MODES

GRADIENTS = REPLICA_GRADIENT_MODES  # steps are measured in one process, with whole gradients
POLICIES = ("bf16", "agoq-paper", "checkpoint-all")
OLDER = "older profile section"
KEY_FIELDS = ("compile", "policy", "activation_memory_budget", "micro_batch", "grad_accum", "gradients", "optimizer",
              "master", "offload_layers")
VERSIONS = (1, 2)  # 2: rows may offload (offload_layers, offloaded_bytes)


def row_key(row: dict) -> tuple:
    """The knob combination a row measured (its KEY_FIELDS, in order)."""
    return tuple(row.get(k) for k in KEY_FIELDS)


def check_row(row: Any, where: str) -> dict:
    """A row with its fields checked and typed; ValueError naming the field otherwise."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a measured step is an object, got {type(row).__name__}")
    choices = {"compile": COMPILE_MODES, "policy": POLICIES, "gradients": GRADIENTS, "optimizer": OPTIMIZERS,
               "master": MASTERS}
    out = dict(row)
    for name, allowed in choices.items():
        if out.get(name) not in allowed:
            raise ValueError(f"{where}.{name}: must be one of {', '.join(allowed)}, got {out.get(name)!r}")
    for name in ("micro_batch", "grad_accum"):
        value = out.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}.{name}: must be an integer >= 1, got {value!r}")
    seconds = out.get("step_seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"{where}.step_seconds: must be a number > 0, got {seconds!r}")
    for name in ("peak_bytes", "first_step_peak_bytes"):
        value = out.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{where}.{name}: must be bytes >= 0 or null, got {value!r}")
    passes = out.get("repeat_peak_bytes")
    if passes is not None and (not isinstance(passes, list) or not passes or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in passes)):
        raise ValueError(f"{where}.repeat_peak_bytes: must be a list of each pass's peak bytes (>= 0) or absent, "
                         f"got {passes!r}")
    budget = out.get("activation_memory_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0 < budget <= 1):
        raise ValueError(f"{where}.activation_memory_budget: must be in (0, 1] or null, got {budget!r}")
    if budget is not None and (out["compile"], out["policy"]) != ("compiled", "bf16"):
        raise ValueError(f"{where}.activation_memory_budget: only compiled bf16 steps have one")
    layers = out.get("offload_layers")
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"{where}.offload_layers: must be an integer >= 1 or absent, got {layers!r}")
        moved = out.get("offloaded_bytes")
        if isinstance(moved, bool) or not isinstance(moved, (int, float)) or moved < 0:
            raise ValueError(f"{where}.offloaded_bytes: a row that offloads gives the bytes it offloaded per "
                             f"micro-batch (>= 0), got {moved!r}")
    return out


def _older_rows(header: dict) -> list[dict]:
    """Rows read from the sections older profiles kept their measured steps in (see the module docstring)."""
    settings = header.get("settings") or {}
    memory = header.get("memory") or {}
    m0 = int(settings.get("micro_batch") or 1)
    used = memory.get("measured_with") or {"optimizer": "adamw", "master": "fp32", "gradients": "bf16"}
    base = {"micro_batch": m0, "grad_accum": 1, "gradients": "bf16", "optimizer": used.get("optimizer", "adamw"),
            "master": used.get("master", "fp32"), "activation_memory_budget": None, "source": OLDER}
    own = str(settings.get("compile_mode") or "eager")
    rows = []

    def add(compile_mode: str, policy: str, step: dict, **changes) -> None:
        if step.get("step_seconds") is None or policy not in POLICIES:
            return
        peak = step.get("peak_bytes", step.get("measured_peak_bytes"))
        rows.append({**base, "compile": compile_mode, "policy": policy, "step_seconds": float(step["step_seconds"]),
                     "peak_bytes": None if peak is None else int(peak), "first_step_peak_bytes": None, **changes})

    for step in memory.get("steps") or []:
        add(own, str(step.get("policy")), step)
    compiled = header.get("compiled") or {}
    base.update(optimizer="adamw8bit", master="fp32")  # the compiled section's loop stepped the fused 8-bit AdamW
    if compiled and own != "compiled":
        for step in compiled.get("steps") or []:
            add("compiled", str(step.get("policy")), step)
        for step in compiled.get("micro_batch_steps") or []:
            if int(step.get("micro_batch") or m0) != m0:
                add("compiled", "bf16", step, micro_batch=int(step["micro_batch"]))
        for point in compiled.get("memory_budget_points") or []:
            add("compiled", "bf16", point, activation_memory_budget=float(point["activation_memory_budget"]))
    return rows


def measured_rows(header: dict, where: str = "profile.json") -> list[dict]:
    """Every measured step of a profile header (see the module docstring), checked; a later row of the same knob
    combination replaces an earlier one."""
    section = header.get("measured_steps")
    if section is None:
        raw = _older_rows(header)
    else:
        if not isinstance(section, dict) or not isinstance(section.get("rows"), list):
            raise ValueError(f"{where}: measured_steps: expected {{'version': 2, 'rows': [...]}}")
        if section.get("version", 1) not in VERSIONS:
            raise ValueError(f"{where}: measured_steps.version {section.get('version')!r} is newer than this agoq "
                             f"reads ({', '.join(map(str, VERSIONS))}): upgrade agoq, or profile again with this one")
        raw = section["rows"]
    rows: dict[tuple, dict] = {}
    for i, row in enumerate(raw):
        checked = check_row(row, f"{where}: measured_steps.rows[{i}]")
        rows[row_key(checked)] = checked
    return list(rows.values())


def section(rows: list[dict]) -> dict:
    """The `measured_steps` section holding `rows` (each checked)."""
    return {"version": VERSIONS[-1], "rows": [check_row(r, f"measured_steps.rows[{i}]") for i, r in enumerate(rows)]}


def find(rows: list[dict], **key: Optional[Any]) -> Optional[dict]:
    """The row measuring exactly `key` (every KEY_FIELDS given; activation_memory_budget and offload_layers default
    to None)."""
    key.setdefault("activation_memory_budget", None)
    key.setdefault("offload_layers", None)
    want = tuple(key.get(k) for k in KEY_FIELDS)
    for row in rows:
        if row_key(row) == want:
            return row
    return None


__all__ = ["measured_rows", "section", "check_row", "row_key", "find", "KEY_FIELDS", "POLICIES", "COMPILE_MODES",
           "GRADIENTS", "OPTIMIZERS", "MASTERS"]
