"""The memory steps of agoq.search.cost_model's `model_problem` that do not depend on the layers' options: a stage's
static bytes (its share of the model state and the rest of the eager step's peak), what a checkpointed layer's
backward holds beyond them, LAAQ's backward transient and the optimizer step's peak. All in bytes, [S] per stage
unless said otherwise; each step appends what a reader of the plan should know to `notes`.

A stage's share of a per-rank byte count is its fraction of the layers, share[s] = (layers in s) / L.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from agoq.formats.profile import ProfileData
from agoq.models.step_peak import head_and_workspace_bytes, head_shape_of, removed_copy_bytes
from agoq.search.layouts import fsdp_in_flight_bytes, unit_sizes
from agoq.search.state import measured_with, state_parts, state_per_rank
from agoq.vocabulary import FSDP2_LAYOUTS, HSDP


def stage_share(stages: np.ndarray) -> np.ndarray:
    """[S] each stage's fraction of the L layers (its share of the state and of whatever scales with the model)."""
    return np.bincount(stages, minlength=int(stages.max()) + 1) / len(stages)


def static_bytes(profile: ProfileData, gradient_mode: str, optimizer: str, master: str, layout: str, accum: int,
                 stages: np.ndarray, units, elem: int, micro_batch: int, notes: list):
    """The static bytes of each stage at the end of forward, as {part: [S] bytes}, with the state per rank
    ({part: bytes}, agoq.search.state) and the LM head's shape (None: unknown) they were built from.

      state parts x share                the model state per rank (weights, gradients, masters, moments)
      + fsdp_unsharded x share           FSDP2's unsharded units in flight (`units`: the layout's unit sizes)
      + backward_gradients x share       QuanGrad: the calibration step's gradients, on top of the 8-bit buffer
      + accumulated_gradients x share    bf16 gradients and accum > 1: the first micro-batch's gradients kept
      + head_and_workspace               the chunked LM head's tensors at `micro_batch` and the calibrated workspace
    """
    share = stage_share(stages)
    profiled_micro_batch = int(profile.settings.get("micro_batch", 1) or 1)
    state = state_per_rank(profile, gradient_mode, optimizer, master, layout)  # bytes per rank
    parts = {name: value * share for name, value in state.items()}  # {part: [S] bytes}
    if layout in FSDP2_LAYOUTS:
        in_flight_weights = fsdp_in_flight_bytes(units, gradient_mode)
        parts["fsdp_unsharded"] = in_flight_weights * share
        ranks = profile.node_size if layout == HSDP else profile.world_size
        notes.append(f"{layout} sharded over {ranks} ranks: {int(sum(state.values()))} bytes of sharded state per "
                     f"rank and {int(in_flight_weights)} bytes of unsharded weights and gradients in flight "
                     "(agoq.search.layouts)")
    # under FSDP2 quangrad8 is hsdp's cross-node all-reduce of FSDP2's own sharded gradients: no 8-bit buffer
    mode = "sdp4bit" if layout in FSDP2_LAYOUTS and gradient_mode == "quangrad8" else gradient_mode
    parts.update(_gradient_corrections(profile, mode, optimizer, master, accum, state, share, notes))
    _note_uncalibrated(profile, notes)
    # the eager step's peak is the chunked loss's forward (agoq.models.step_peak): the head's tensors at this
    # micro-batch and the calibrated workspace (the gradient storage there is the QuanGrad correction above)
    head = head_shape_of(profile.memory, profile.model_config(), profiled_micro_batch,
                         int(profile.settings.get("seq_len", 1)), elem)
    parts["head_and_workspace"] = np.full(len(share), head_and_workspace_bytes(profile.memory, head, micro_batch,
                                                                               profiled_micro_batch))
    older = removed_copy_bytes(profile.memory, head)
    if older > 0:
        notes.append(f"this profile was measured while the LM loss held {int(older)} bytes more at its peak (a "
                     "float32 copy of each chunk's weight gradient, since removed): a compiled plan whose peak "
                     "is the loss's forward may be predicted up to that much high; run `agoq profile` again to "
                     "plan with that memory")
    return parts, state, head


def _gradient_corrections(profile: ProfileData, gradient_mode: str, optimizer: str, master: str, accum: int,
                          state: dict, share: np.ndarray, notes: list) -> dict:
    """{part: [S] bytes} of gradients the fwd + bwd peak holds that the calibrated fixed bytes do not count.

    fixed_bytes was calibrated on a step whose gradients (of `measured_with(profile)`'s mode) mostly did not exist yet
    at its fwd + bwd peak. QuanGrad's buffer is allocated before the step while backward still makes each bf16
    gradient: the peak keeps the calibration step's gradients and the buffer too. With bf16 gradients and several
    micro-batches, the first one's gradients are kept while the next ones run forward and backward."""
    calibrated = measured_with(profile)
    grads_calibrated = state_parts(profile, calibrated["gradients"], optimizer, master)["gradients"]
    if gradient_mode == "quangrad8" and calibrated["gradients"] != "quangrad8":
        notes.append(f"QuanGrad's 8-bit gradient buffer is counted on top of the {calibrated['gradients']} gradients "
                     "the profile's fixed bytes were calibrated with (+"
                     f"{int(grads_calibrated)} bytes at the fwd + bwd peak)")
        return {"backward_gradients": grads_calibrated * share}
    if gradient_mode == "bf16" and accum > 1 and calibrated["gradients"] == "bf16":
        notes.append(f"with {accum} micro-batches per step the gradients of the first are kept through the others' "
                     f"forward and backward (+{int(state['gradients'])} bytes at the fwd + bwd peak)")
        return {"accumulated_gradients": state["gradients"] * share}
    return {}


def _note_uncalibrated(profile: ProfileData, notes: list) -> None:
    """Besides the layers' activations a step holds what embedding, final norm, head and loss keep
    (outside_activation_bytes) and the calibrated rest (fixed_bytes: logits' gradient, workspace); without allocator
    statistics where it was profiled the rest is unknown, which the notes say."""
    outside = float(profile.memory.get("outside_activation_bytes") or 0)
    if profile.memory.get("fixed_bytes") is None:
        notes.append("this profile was made on a device without allocator statistics (the CPU), so the memory "
                     "model could not measure the step's workspace (temporaries): predicted peaks count only "
                     "weights, gradients, optimizer state, activations and the LM head's modelled tensors "
                     f"(at least the {int(outside)} bytes kept outside the decoder layers); profile on the GPU you "
                     "will train on for peaks you can budget by")


def end_of_backward(profile: ProfileData, gradient_mode: str, accum: int, layout: str, gradient_bytes: float,
                    stages: np.ndarray, head_bytes: float) -> np.ndarray:
    """[L] what the backward of checkpointed layer l holds beyond the end of forward's static bytes, in bytes.

    By then the LM head's tensors (`head_bytes`, counted at the end of forward) are freed, and with bf16 gradients
    and one micro-batch per step the gradients backward has made exist: the head's and final norm's, and those of
    layers l..L-1 (the end of forward's static bytes count the gradients as the calibration step found them, not
    made yet). QuanGrad's 8-bit buffer and accumulated bf16 gradients are in the static bytes already. The layers'
    share of `gradient_bytes` (the stage's) follows the model config's parameter counts; without a usable config
    every gradient is counted as made (an upper bound)."""
    L = len(stages)
    made = np.zeros(L)
    if gradient_mode == "bf16" and accum == 1 and layout not in FSDP2_LAYOUTS:
        made[:] = 1.0
        config = profile.model_config() or {}
        try:
            units = unit_sizes(config, int(profile.header["model"].get("parameters") or 0), L)
        except ValueError:
            units = None
        if units is not None and units.layer > 0:
            embedding = 0 if config.get("tie_word_embeddings") else \
                int(config.get("vocab_size") or 0) * int(config.get("hidden_size") or 0)
            head = max(0, units.root - embedding)
            for l in range(L):
                same = stages == stages[l]
                later = int((same & (np.arange(L) >= l)).sum())
                total = units.layer * int(same.sum()) + (units.root if stages[l] == stages.max() else 0)
                made[l] = (units.layer * later + (head if stages[l] == stages.max() else 0)) / max(total, 1)
    share = np.bincount(stages, minlength=int(stages.max()) + 1) / L
    return made * gradient_bytes * share[stages] - head_bytes


def laaq_transient(profile: ProfileData, micro_batch: int, num_stages: int, notes: list) -> Optional[np.ndarray]:
    """[S] bytes LAAQ's backward holds beyond the memory model (dequantized copies it does not list): the agoq-paper
    step's measured fwd + bwd peak less its prediction (both from the profile), scaled by micro_batch / profiled
    micro-batch. None where the profile has no such step."""
    profiled_micro_batch = int(profile.settings.get("micro_batch", 1) or 1)
    paper = next((st for st in profile.memory.get("steps", []) or [] if st.get("policy") == "agoq-paper"), {})
    measured_fb = paper.get("measured_peak_bytes_forward_backward")
    predicted_fb = paper.get("predicted_peak_bytes_forward_backward")
    if measured_fb is None or predicted_fb is None:
        return None
    over = max(0.0, float(measured_fb) - float(predicted_fb)) * (micro_batch / profiled_micro_batch)
    notes.append(f"LAAQ backward transient of {int(over)} bytes per stage, from the profile's agoq-paper step")
    return np.full(num_stages, over)


def optimizer_floor(profile: ProfileData, gradient_mode: str, optimizer: str, master: str, state: dict,
                    share: np.ndarray):
    """The optimizer step's peak per stage, (floor [S] bytes, {part: [S] bytes}), or (None, None) where the profile
    measured none: the state per rank plus the measured step's workspace, fixed_bytes_optimizer_step, with the
    profile's optimizer's transient swapped for this one's (agoq.search.state's step_transient)."""
    fixed_opt = profile.memory.get("fixed_bytes_optimizer_step")
    if fixed_opt is None:
        return None, None
    calibrated = measured_with(profile)
    transient = state_parts(profile, gradient_mode, optimizer, master)["step_transient"] \
        - state_parts(profile, gradient_mode, calibrated["optimizer"], calibrated["master"])["step_transient"]
    parts = {name: value * share for name, value in state.items()}
    parts["optimizer_step_workspace"] = (float(fixed_opt) + transient) * share
    return sum(parts.values()), parts


__all__ = ["stage_share", "static_bytes", "end_of_backward", "laaq_transient", "optimizer_floor"]
