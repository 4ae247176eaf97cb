"""The model state a plan keeps per rank: weights, gradients, float32 masters and optimizer moments, from the
profile's memory section, under a gradient storage, an optimizer with its masters, and a data-parallel layout.

Per rank of a stage, bytes (W, G, M, A: the whole model's weights, gradients of the gradient storage, masters
and moments; N: the profile's world size, S: its node size, ProfileData.node_size):

  replicated (DDP, one process)   W, G, M, A
  fsdp (FSDP2)                    W / N, G / N, M / N, A / N  (G: bf16 gradients; agoq.search.layouts)
  hsdp (FSDP2, R x S)             W / S, G / S, M / S, A / S  (sharded within a node; agoq.search.hsdp)

A pipeline stage keeps its layers' share of these (agoq.search.costs).
"""

from __future__ import annotations

from typing import Optional

from agoq.formats.profile import ProfileData
from agoq.runtime.optim.state_bytes import check_combination
from agoq.search.layouts import resolve_layout
from agoq.vocabulary import FSDP2_LAYOUTS, GRADIENT_MODES, HSDP

OLD_MEASURED_WITH = {"optimizer": "adamw", "master": "fp32", "gradients": "bf16"}  # profiles before the fused step
STATE_PARTS = ("weights", "gradients", "masters", "optimizer_state")  # the plan's names (docs/formats.md)


def measured_with(profile: ProfileData) -> dict:
    """The optimizer, masters and gradient storage of the profile's measured steps (its calibration)."""
    return dict(profile.memory.get("measured_with") or OLD_MEASURED_WITH)


def resolve_optimizer(profile: ProfileData, optimizer: Optional[str], master: Optional[str]) -> tuple[str, str]:
    """(optimizer, master) with None read as the profile's measured step's; raises ValueError for a combination
    the trainer refuses."""
    base = measured_with(profile)
    optimizer = optimizer or base["optimizer"]
    master = master or base["master"]
    check_combination(optimizer, master)
    return optimizer, master


def optimizer_choices(gradient_mode: str, layout: Optional[str] = None) -> list[tuple[str, str]]:
    """(optimizer, master) combinations a plan may use with `gradient_mode` under `layout` (None: the mode's own;
    every layout runs every combination)."""
    resolve_layout(layout, gradient_mode)
    return [("adamw", "fp32"), ("adamw8bit", "fp32"), ("adamw8bit", "none")]


def state_parts(profile: ProfileData, mode: str, optimizer: Optional[str] = None,
                master: Optional[str] = None) -> dict:
    """Bytes of the whole model's weights, gradients (gradient mode `mode`), masters, moments and the optimizer
    step's transient (see agoq.runtime.optim.state_bytes), from the profile's memory section. Profiles written before it
    recorded `state` give masters as master_bytes, moments as optimizer_bytes_adamw / _adamw8bit and torch AdamW's
    float32 gradient copies as master_bytes."""
    if mode not in GRADIENT_MODES:
        raise ValueError(f"gradient mode must be one of {', '.join(GRADIENT_MODES)}, got {mode!r}")
    optimizer, master = resolve_optimizer(profile, optimizer, master)
    mem = profile.memory
    weights = float(mem.get("weights_bytes") or profile.header["model"].get("weight_bytes") or 0)
    grads_bf16 = float(mem.get("gradients_bytes_bf16") or weights)
    grads = {"bf16": grads_bf16, "quangrad8": float(mem.get("gradients_bytes_quangrad8") or grads_bf16),
             "sdp4bit": grads_bf16}
    state = (mem.get("state") or {}).get("optimizers", {}).get(f"{optimizer}/{master}")
    if state is not None:
        masters, moments, transient = (float(state[k]) for k in ("masters", "moments", "step_transient"))
    else:
        fp32 = float(mem.get("master_bytes") or 0)
        masters = fp32 if master == "fp32" else 0.0
        if optimizer == "adamw":
            moments = float(mem.get("optimizer_bytes_adamw") or 0)
        else:
            moments = float(mem.get("optimizer_bytes_adamw8bit") or mem.get("optimizer_bytes_adamw") or 0)
        transient = fp32 if (optimizer, master) == ("adamw", "fp32") else 0.0
    return {"weights": weights, "gradients": grads[mode], "masters": masters, "moments": moments,
            "step_transient": transient, "optimizer": optimizer, "master": master}


def state_per_rank(profile: ProfileData, mode: str, optimizer: Optional[str] = None, master: Optional[str] = None,
                   layout: Optional[str] = None) -> dict[str, float]:
    """{weights, gradients, masters, optimizer_state}: bytes of the model state one rank keeps under `layout` (None:
    the gradient mode's own), from `state_parts` (see the module docstring)."""
    layout = resolve_layout(layout, mode)
    ranks = profile.node_size if layout == HSDP else profile.world_size  # the ranks one copy is sharded over
    parts = state_parts(profile, "bf16" if layout in FSDP2_LAYOUTS else mode, optimizer, master)
    whole = {"weights": parts["weights"], "gradients": parts["gradients"], "masters": parts["masters"],
             "optimizer_state": parts["moments"]}
    sharded = STATE_PARTS if layout in FSDP2_LAYOUTS else ()
    return {name: value / ranks if name in sharded else value for name, value in whole.items()}


def static_bytes_total(profile: ProfileData, mode: str, optimizer: Optional[str] = None,
                       master: Optional[str] = None) -> float:
    """Weights + masters + gradients + optimizer moments one rank keeps under a gradient mode's own layout and an
    optimizer (None: the profile's measured step's; see `state_parts`): sdp4bit gradients run under FSDP2, which
    keeps 1/world of the whole state per rank."""
    return sum(state_per_rank(profile, mode, optimizer, master).values())


__all__ = ["GRADIENT_MODES", "OLD_MEASURED_WITH", "STATE_PARTS", "measured_with", "resolve_optimizer",
           "optimizer_choices", "state_parts", "state_per_rank", "static_bytes_total"]
