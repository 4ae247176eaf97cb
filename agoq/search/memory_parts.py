"""What a plan's predicted peak is made of: per pipeline stage, the phase of the step that sets the peak and the
bytes of each part at that moment, on one rank of the stage. The parts add up to the stage's predicted peak; a
plan records them as `predicted.memory_per_stage` (docs/formats.md) and the dashboard draws them as they are.

Phases (stated once, with their terms, in agoq.search.memory_phases, whose evaluator and explanation
ChoiceProblem.evaluate and .memory_parts use; the peak is the largest):

  forward_backward     the end of forward: the state, the rest of the step and every in-flight micro-batch's
                       activations, plus LAAQ's backward transient
  backward_start       with layers offloaded: the start of backward, when the first prefetch brings one offloaded
                       layer back: the end of forward's parts, less the LM head's tensors (freed by then) and plus
                       the gradients made by then (both in end_of_backward), plus the prefetched layer
  offload_backward     with layers offloaded: the backward of an offloaded layer (`layer` 0 or 1), the gradients
                       of the layers above it made, the offloaded layers it holds then (its own, and at layer 1 the
                       next one's) and what its backward allocates on top; or (no `layer`) that allocation on top of
                       the start of backward's level, which backward's fetch-ahead fills again
  checkpoint_backward  the backward of a checkpointed layer (`layer`): the state, the rest of the step, what the
                       micro-batches hold then and the layer's rerun forward
  optimizer_step       the optimizer step: the state and the step's own workspace, no activations

Parts, bytes per rank of the stage (sharded layouts: this rank's shard; agoq.search.state):

  weights, gradients, masters, optimizer_state   the model state (optimizer_state: AdamW's float32 moments or the
                                                 8-bit AdamW's, as the plan's optimizer)
  fsdp_unsharded         FSDP2's all-gathered bf16 weights and one unit's unsharded gradients (agoq.search.layouts)
  backward_gradients     QuanGrad: the bf16 gradients backward makes before they are stored in 8 bits
  accumulated_gradients  bf16 gradients with several micro-batches per step: the earlier micro-batches' gradients,
                         kept through the next one's forward and backward
  head_and_workspace     the LM head's tensors at this micro-batch and the calibrated workspace, less the gradients
                         not made yet at that moment (agoq.models.step_peak; may be negative)
  calibration            what the profile's measured peaks add to the model's per-layer bytes (agoq.search.calibration)
  margin                 the margin learnt from the calibrated model's misses on the profile's measured steps
  compiled_margin        (plans of earlier versions) their compiled peak margin
  layout_margin          over several ranks: the profile's measured layout step's peak per rank less the model's
                         (agoq.search.layout_calibration; may be negative)
  activations            what the decoder layers keep for backward at that moment
  recomputed_layer       a checkpointed layer's rerun forward
  end_of_backward        in checkpoint_backward (and backward_start, at the top layer): what the step holds then
                         beyond what the end of forward's parts
                         count: the bf16 gradients made by then (without accumulation; with it, or with QuanGrad, they
                         are counted already), less the LM head's tensors, freed by then
  laaq_transient         what LAAQ's backward holds beyond the memory model (dequantized copies)
  offload_prefetch       with layers offloaded to host memory (backward_start, checkpoint_backward): the largest
                         offloaded layer's tensors, which backward's first prefetch brings back before backward has
                         freed anything; in offload_backward at a layer, the offloaded layers' tensors it holds
  offload_backward       what an offloaded layer's backward allocates beyond its fetched tensors (measured on the
                         profile's offloading step: agoq.search.calibration)
  offload_backlog        offloaded bytes the host link has not yet copied out when forward ends (still on the GPU)
  offload_floor          with layers offloaded: what lifts the peak to the profile's measured offloading step's
                         (the end of backward, every gradient made; agoq.search.calibration)
  optimizer_step_workspace  the optimizer step's measured temporaries and its transient
"""

from __future__ import annotations

import math

from agoq.formats.plan import MEMORY_PHASES as PHASES

PARTS = ("weights", "gradients", "masters", "optimizer_state", "fsdp_unsharded", "backward_gradients",
         "accumulated_gradients", "head_and_workspace", "calibration", "margin", "compiled_margin", "layout_margin",
         "activations",
         "recomputed_layer", "end_of_backward", "laaq_transient", "offload_prefetch", "offload_backward",
         "offload_backlog", "offload_floor", "optimizer_step_workspace")


PHASE_NAMES = {"forward_backward": "end of forward", "backward_start": "start of backward (first prefetch)",
               "offload_backward": "backward of an offloaded layer", "optimizer_step": "optimizer step"}


def phase_name(phase: str, layer=None) -> str:
    """A phase in words: 'end of forward', 'start of backward (first prefetch)', 'optimizer step', 'backward of
    checkpointed layer N'."""
    if phase == "checkpoint_backward":
        return f"backward of checkpointed layer {layer}"
    if phase == "offload_backward" and layer is not None:
        return f"backward of offloaded layer {layer}"
    return PHASE_NAMES.get(phase, phase)


def whole_bytes(parts: dict[str, float], total: int) -> dict[str, int]:
    """`parts` in whole bytes adding up to `total` exactly: each rounded down, and the bytes left over (the
    rounding, and the peak's rounding up to a whole byte) one each to the parts with the largest fractions."""
    out = {name: math.floor(value) for name, value in parts.items()}
    left = int(total) - sum(out.values())
    if not out or left == 0:
        return out
    by_fraction = sorted(out, key=lambda name: out[name] - parts[name])  # largest fraction first
    order = by_fraction if left > 0 else by_fraction[::-1]
    step = 1 if left > 0 else -1
    for i in range(abs(left)):
        out[order[i % len(order)]] += step
    return out


def stage_entry(stage: int, phase: str, layer, parts: dict[str, float], peak: int) -> dict:
    """One stage's `predicted.memory_per_stage` entry: its phase (with the checkpointed layer for
    checkpoint_backward) and its parts in whole bytes adding up to `peak`."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown memory part(s) {unknown}; the parts are {', '.join(PARTS)}")
    entry = {"stage": int(stage), "phase": phase, "parts": whole_bytes(parts, peak)}
    if phase == "checkpoint_backward" or (phase == "offload_backward" and layer is not None):
        entry["layer"] = int(layer)
    return entry


__all__ = ["PHASES", "PARTS", "PHASE_NAMES", "phase_name", "whole_bytes", "stage_entry"]
