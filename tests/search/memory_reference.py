"""The per-rank memory model as it was written before agoq.search.memory_phases described its phases as data: the
reference that tests/search/test_memory_phases.py holds the phases' evaluator and explanation to, bit for bit
(kept here, in the tests only)."""

from __future__ import annotations

import numpy as np

from agoq.runtime.activations.policy import KINDS
from agoq.search.memory_parts import stage_entry


def old_memory(self, chosen: np.ndarray, ckpt: np.ndarray, offload=None) -> dict:
    """Per stage: the peak (bytes), the phase that sets it (agoq.search.memory_parts) with its checkpointed
    layer, and what the decoder layers hold then ("held") and its rerun layer's bytes ("rerun"); also the
    activations at the end of forward, the LAAQ transient, the number of layers running LAAQ, and with
    `offload` (bool per layer) the bytes on the host and the prefetch reserve per stage."""
    per_layer = np.zeros(self.num_layers)  # bytes each layer adds to its stage (x in-flight)
    np.add.at(per_layer, self.layer[chosen], self.memory[chosen])
    per_layer[ckpt] += self.checkpoint_memory[ckpt]
    calibration = np.zeros(self.num_layers)  # the calibration's bytes per layer (unmodified or checkpointed)
    if self.checkpoint_calibration is not None:
        calibration[ckpt] += self.checkpoint_calibration[ckpt]
    is16 = self.keeps_16bit()
    laaq = np.zeros(self.num_layers, dtype=bool)  # layers running LAAQ's functions
    for l in range(self.num_layers):
        if ckpt[l]:
            continue
        mine = chosen[self.layer[chosen] == l]
        kinds16 = {int(self.kind[i]) for i in mine if is16[i]}
        if len(kinds16) == len({int(self.kind[i]) for i in mine}):
            per_layer[l] += self.unmodified_extra[l]
            if self.unmodified_calibration is not None:
                calibration[l] += self.unmodified_calibration[l]
        if {KINDS.index("attention"), KINDS.index("o_proj_input")} <= kinds16:
            per_layer[l] -= self.shared_credit[l]
        laaq[l] = not all(self.option[i] == "16" for i in mine)
    off = self.offload_mask(offload)
    on_host = np.where(off, np.maximum(per_layer + calibration, 0.0), 0.0)  # what an offloaded layer keeps
    per_layer[off], calibration[off] = 0.0, 0.0
    host, reserve = np.zeros(self.num_stages), np.zeros(self.num_stages)
    np.add.at(host, self.layer_stage, on_host)
    np.maximum.at(reserve, self.layer_stage, on_host)
    backlog = np.zeros(self.num_stages)  # not yet copied out when forward ends
    if self.offload is not None:
        backlog = np.maximum(0.0, host - self.offload.forward_link_bytes)
    activations, calibrated = np.zeros(self.num_stages), np.zeros(self.num_stages)
    np.add.at(activations, self.layer_stage, per_layer)
    np.add.at(calibrated, self.layer_stage, calibration)
    laaq_stage = np.zeros(self.num_stages, dtype=bool)
    laaq_stage[self.layer_stage[laaq]] = True
    transient = np.where(laaq_stage, self.laaq_transient(), 0.0)
    mem = self.static_bytes + activations + calibrated + transient + backlog
    phase, at_layer = ["forward_backward"] * self.num_stages, [None] * self.num_stages
    # the start of backward, where offloading: backward's first prefetch in flight, the LM head's tensors freed
    # and its gradients made (the top layer's end_of_backward bytes, which count that layer's too)
    start = np.full(self.num_stages, -np.inf)
    if off.any():
        start = mem + reserve + self.end_of_backward_bytes()[self.top_layers()]
        for s in np.nonzero(start > mem)[0]:
            mem[s], phase[s] = start[s], "backward_start"
    # the backward of an offloaded layer (OffloadPrices): at layer 0, at layer 1, and on top of the start of
    # backward's level, which backward's fetch-ahead fills again
    level_at_offloaded = np.full(self.num_stages, -np.inf)  # layers 0 and 1's, less backward_bytes
    fetched = np.zeros(self.num_stages)  # the offloaded layers' bytes backward holds then
    if off.any():
        eob, d = self.end_of_backward_bytes(), self.offload.backward_bytes
        top2 = float(np.sort(on_host[off])[-2:].sum())
        values = [(None, start + d, reserve)]
        values += [(l, self.static_bytes + eob[l] + held_bytes + d, held_bytes)
                   for l, held_bytes in ((0, reserve), (1, np.full(self.num_stages, top2)))
                   if l < self.num_layers and off[l]]
        for l, value, held_bytes in values:
            for s in range(self.num_stages):
                if l is not None and self.layer_stage[l] != s:
                    continue
                if l is not None:
                    level_at_offloaded[s] = max(level_at_offloaded[s], value[s] - d)
                if value[s] > mem[s]:
                    mem[s], phase[s], at_layer[s], fetched[s] = value[s], "offload_backward", l, held_bytes[s]
    held, rerun, held_calibration = activations.copy(), np.zeros(self.num_stages), calibrated.copy()
    for s in range(self.num_stages):
        if phase[s] == "offload_backward" and at_layer[s] is not None:  # the layers above it are done
            held[s], held_calibration[s] = 0.0, 0.0
    checkpoint_peak = np.full(self.num_stages, -np.inf)  # the largest checkpoint_backward value per stage
    # backward of a checkpointed layer l: the other in-flight micro-batches, this one's layers before l,
    # and l's input plus everything its rerun forward keeps
    flight, extra = self.in_flight_counts(), self.recomputed()
    for l in np.nonzero(ckpt)[0]:
        s = self.layer_stage[l]
        earlier = (self.layer_stage == s) & (np.arange(self.num_layers) < l)
        kept = (flight[s] - 1) / flight[s] * activations[s] + per_layer[earlier].sum() / flight[s] \
            + self.checkpoint_memory[l] / flight[s]
        kept_calibration = (flight[s] - 1) / flight[s] * calibrated[s] + calibration[earlier].sum() / flight[s] \
            + calibration[l] / flight[s]
        during = self.static_bytes[s] + kept + kept_calibration + extra[l] + transient[s] + reserve[s]
        checkpoint_peak[s] = max(checkpoint_peak[s], during)
        if during > mem[s]:
            mem[s], phase[s], at_layer[s], held[s], rerun[s] = during, "checkpoint_backward", int(l), kept, extra[l]
            held_calibration[s] = kept_calibration
    offload_floor = np.zeros(self.num_stages)  # what the measured offloading peak adds (OffloadPrices)
    if self.offload is not None and off.any():
        offload_floor = np.maximum(0.0, self.offload.floor_bytes - mem)
        mem = mem + offload_floor
    floor = self.peak_floor()
    for s in np.nonzero(floor > mem)[0]:
        mem[s], phase[s], at_layer[s] = floor[s], "optimizer_step", None
    # whole bytes, rounded up (a fraction of a byte over a budget is over it; 1e-6 absorbs float noise)
    return {"peak": [int(np.ceil(m - 1e-6)) for m in mem], "phase": phase, "layer": at_layer, "held": held,
            "rerun": rerun, "activations": activations, "transient": transient, "laaq_layers": int(laaq.sum()),
            "held_calibration": held_calibration, "host": host, "reserve": reserve, "backlog": backlog,
            "offload_floor": offload_floor, "checkpoint_peak": checkpoint_peak,
            "level_at_offloaded": level_at_offloaded, "fetched": fetched}



def old_memory_parts(self, chosen: np.ndarray, checkpoint: np.ndarray, offload=None) -> list[dict]:
    """Per stage, the phase that sets its peak and the parts of the peak then, in whole bytes adding up to the
    stage's `evaluate` peak (agoq.search.memory_parts; a plan's `predicted.memory_per_stage`)."""
    if self.static_parts is None or (self.floor_bytes is not None and self.floor_parts is None):
        raise ValueError("this problem does not list the parts of its static bytes (build_problem's do)")
    m = old_memory(self, np.asarray(chosen, dtype=int), np.asarray(checkpoint, dtype=bool), offload)
    out = []
    for s in range(self.num_stages):
        if m["phase"][s] == "optimizer_step":
            parts = {name: float(v[s]) for name, v in self.floor_parts.items()}
        else:
            parts = {name: float(v[s]) for name, v in self.static_parts.items()}
            parts["calibration"] = parts.get("calibration", 0.0) + float(m["held_calibration"][s])
            parts["activations"] = float(m["held"][s])
            if m["phase"][s] == "checkpoint_backward":
                own = float(self.rerun_calibrated()[m["layer"][s]])
                phase_bytes = float(self.end_of_backward_bytes()[m["layer"][s]])
                parts["recomputed_layer"] = float(m["rerun"][s]) - own - phase_bytes
                parts["calibration"] += own
                if phase_bytes:
                    parts["end_of_backward"] = phase_bytes
            at_offloaded = m["phase"][s] == "offload_backward" and m["layer"][s] is not None
            if m["phase"][s] in ("backward_start", "offload_backward"):
                at = int(m["layer"][s]) if at_offloaded else int(self.top_layers()[s])
                if self.end_of_backward_bytes()[at]:
                    parts["end_of_backward"] = float(self.end_of_backward_bytes()[at])
            if m["phase"][s] == "offload_backward":
                parts["offload_backward"] = float(self.offload.backward_bytes)
            if not at_offloaded:  # the backward of layer 0 or 1 holds no other layer's activations
                parts["laaq_transient"] = float(m["transient"][s])
            if at_offloaded:
                parts["offload_prefetch"] = float(m["fetched"][s])
            elif m["reserve"][s] > 0 and m["phase"][s] != "forward_backward":
                parts["offload_prefetch"] = float(m["reserve"][s])
            if not at_offloaded and m["phase"][s] != "checkpoint_backward" and m["backlog"][s] > 0:
                parts["offload_backlog"] = float(m["backlog"][s])
            if m["offload_floor"][s] > 0:
                parts["offload_floor"] = float(m["offload_floor"][s])
        out.append(stage_entry(s, m["phase"][s], m["layer"][s], parts, m["peak"][s]))
    return out

