"""The per-rank memory model of a step, written once as data: the phases of the step (`PHASES`), each the sum of
named terms on top of the stage's static bytes, and the floors under them (`evaluate`). The reference evaluator
(`evaluate`, ChoiceProblem.evaluate's peaks), the explanation of a peak (`explain`, a plan's
`predicted.memory_per_stage`: agoq.search.memory_parts) and the MILP's memory rows (agoq.search.milp_rows) are
built from these phases (agoq.search.milp_phases), and so are the offload enumeration's rows and a count level's
least bytes (agoq.search.milp_offload_configs, milp_levels, through `phase_sum`); a phase added here is added to each.

All amounts are bytes on one rank of a pipeline stage s (sharded layouts: this rank's shard), f_s the micro-batches
stage s holds in flight (ChoiceProblem.in_flight_counts), and a layer's bytes already x f_s (ChoiceProblem.memory).
A layer l of stage s keeps a_l: its chosen options' bytes, + unmodified_extra_l where every kind is at 16, -
shared_credit_l where attention and o_proj_input both are, + checkpoint_memory_l (its input) where checkpointed;
and calibration bytes c_l (unmodified_calibration_l or checkpoint_calibration_l). An offloaded layer (a prefix
0..K-1 of one stage: OffloadPrices) keeps a_l and c_l on the host instead: its host bytes are max(0, a_l + c_l).

Quantities of a stage s (one value per stage):

  activations       sum_l a_l over the stage's layers kept on the GPU
  calibration       sum_l c_l over the same layers
  laaq_transient    the stage's measured LAAQ backward transient where any of its layers runs LAAQ's functions
                    (neither all at 16 nor checkpointed), else 0
  offload_backlog   max(0, host_s - forward_link_bytes): offloaded bytes not yet copied out when forward ends
  prefetch          the largest offloaded layer's host bytes (backward's first prefetch)
  top_end_of_backward  end_of_backward at the stage's top layer (the first that backward runs)
  offload_backward  OffloadPrices.backward_bytes: what an offloaded layer's backward allocates on its fetched tensors
                    (never negative: agoq.search.calibration.offload_backward_bytes)
  nothing           0 (what a phase holds none of)

Quantities of a layer l (its phase is at layer l, of stage s):

  held              at checkpointed l: (f_s - 1)/f_s x activations_s + sum_{l' < l of s} a_l' / f_s + input_l / f_s
                    (the other micro-batches, this one's layers below l, and l's input)
  held_calibration  the same of the calibration bytes c
  rerun             ChoiceProblem.recomputed()_l = recompute_bytes_l + rerun_calibration_l + end_of_backward_l
  rerun_calibration, end_of_backward   their own values (parts of `rerun`)
  fetched           at offloaded layer 0: prefetch_s; at offloaded layer 1: the two largest offloaded layers' bytes

A phase's value is static_s + its terms, added in the order listed (the evaluator's floats, bit for bit); the peak
is the largest phase value, the first listed winning a tie; then the floors: `offload_floor` lifts an offloading
choice's peak to OffloadPrices.floor_bytes, and `optimizer_step` (ChoiceProblem.peak_floor, with its own parts)
replaces the peak where it is larger. Each term is shown as a memory part (agoq.search.memory_parts.PARTS), always
or only where it is not zero; a term's `splits` are shown as their own parts and taken out of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from agoq.runtime.activations.policy import KINDS

ALWAYS, NONZERO = "always", "nonzero"
STAGE, CHECKPOINTED = "stage", "checkpointed"   # where a phase applies (also "offloaded", at `layer`)


@dataclass(frozen=True)
class Term:
    """A quantity (module docstring) the phase holds, shown as the memory part `part` (`shown`: always, or only
    where not zero); `splits`: (quantity, part, shown) included in it, shown as their own parts."""

    quantity: str
    part: str
    shown: str = ALWAYS
    splits: tuple = ()


@dataclass(frozen=True)
class Phase:
    """A moment of the step: its name (agoq.formats.plan.MEMORY_PHASES), where it applies (`at`: each stage, each
    checkpointed layer, or offloaded layer `layer`), whether only where layers are offloaded, and its terms."""

    name: str
    terms: tuple
    at: str = STAGE
    layer: Optional[int] = None
    offloading: bool = False


FORWARD = (Term("activations", "activations"), Term("calibration", "calibration"),
           Term("laaq_transient", "laaq_transient"), Term("offload_backlog", "offload_backlog", NONZERO))
START = FORWARD + (Term("prefetch", "offload_prefetch", NONZERO),
                   Term("top_end_of_backward", "end_of_backward", NONZERO))
AT_OFFLOADED = (Term("nothing", "activations"), Term("nothing", "calibration"),
                Term("end_of_backward", "end_of_backward", NONZERO), Term("fetched", "offload_prefetch"),
                Term("offload_backward", "offload_backward"))

PHASES = (
    # the end of forward: the state, the rest of the step, every in-flight micro-batch's activations
    Phase("forward_backward", FORWARD),
    # the first prefetch lands before backward frees anything; the LM head's tensors freed, its gradients made
    Phase("backward_start", START, offloading=True),
    # an offloaded layer's backward on the start's level, which backward's fetch-ahead fills again
    Phase("offload_backward", START + (Term("offload_backward", "offload_backward"),), offloading=True),
    # the backward of offloaded layers 0 and 1: the layers above done, the fetched layers held
    Phase("offload_backward", AT_OFFLOADED, at="offloaded", layer=0, offloading=True),
    Phase("offload_backward", AT_OFFLOADED, at="offloaded", layer=1, offloading=True),
    # the backward of a checkpointed layer: what the micro-batches hold then, and its rerun forward
    Phase("checkpoint_backward", (
        Term("held", "activations"), Term("held_calibration", "calibration"),
        Term("rerun", "recomputed_layer", splits=(("rerun_calibration", "calibration", ALWAYS),
                                                  ("end_of_backward", "end_of_backward", NONZERO))),
        Term("laaq_transient", "laaq_transient"), Term("prefetch", "offload_prefetch", NONZERO)), at=CHECKPOINTED),
)

LAYER_QUANTITIES = ("held", "held_calibration", "rerun", "rerun_calibration", "end_of_backward", "fetched")

# the order parts are listed in after the static parts (whole_bytes gives a rounding's spare bytes in this order)
SHOWN_ORDER = ("calibration", "activations", "recomputed_layer", "end_of_backward", "offload_backward",
               "laaq_transient", "offload_prefetch", "offload_backlog", "offload_floor")


@dataclass
class Quantities:
    """The quantities of one choice (module docstring): `stage` {name: [S]}, `layer` {name: [L]}, and what the
    evaluation reports beside the peak."""

    stage: dict
    layer: dict
    layer_stage: np.ndarray
    checkpointed: np.ndarray   # [L] bool
    offloaded: np.ndarray      # [L] bool
    static: np.ndarray         # [S]
    host: np.ndarray           # [S] bytes on the host
    laaq_layers: int

    def value(self, quantity: str, stage: int, layer: Optional[int]):
        if quantity in LAYER_QUANTITIES:
            return self.layer[quantity][layer]
        return self.stage[quantity][stage]

    def places(self, phase: Phase) -> list:
        """(stage, layer) where `phase` applies for this choice, in order."""
        if phase.offloading and not self.offloaded.any():
            return []
        if phase.at == STAGE:
            return [(s, None) for s in range(len(self.static))]
        if phase.at == CHECKPOINTED:
            return [(int(self.layer_stage[l]), int(l)) for l in np.nonzero(self.checkpointed)[0]]
        l = phase.layer
        return [(int(self.layer_stage[l]), l)] if l < len(self.offloaded) and self.offloaded[l] else []


def quantities(p, chosen: np.ndarray, ckpt: np.ndarray, offload=None) -> Quantities:
    """The quantities (module docstring) of problem `p` (a ChoiceProblem) for a choice: `chosen` option indices,
    `ckpt` bool [L], `offload` bool [L] or None."""
    L, S = p.num_layers, p.num_stages
    per_layer = np.zeros(L)  # a_l
    np.add.at(per_layer, p.layer[chosen], p.memory[chosen])
    per_layer[ckpt] += p.checkpoint_memory[ckpt]
    calibration = np.zeros(L)  # c_l
    if p.checkpoint_calibration is not None:
        calibration[ckpt] += p.checkpoint_calibration[ckpt]
    is16 = p.keeps_16bit()
    laaq = np.zeros(L, dtype=bool)  # layers running LAAQ's functions
    for l in range(L):
        if ckpt[l]:
            continue
        mine = chosen[p.layer[chosen] == l]
        kinds16 = {int(p.kind[i]) for i in mine if is16[i]}
        if len(kinds16) == len({int(p.kind[i]) for i in mine}):
            per_layer[l] += p.unmodified_extra[l]
            if p.unmodified_calibration is not None:
                calibration[l] += p.unmodified_calibration[l]
        if {KINDS.index("attention"), KINDS.index("o_proj_input")} <= kinds16:
            per_layer[l] -= p.shared_credit[l]
        laaq[l] = not all(p.option[i] == "16" for i in mine)
    off = p.offload_mask(offload)
    on_host = np.where(off, np.maximum(per_layer + calibration, 0.0), 0.0)
    per_layer[off], calibration[off] = 0.0, 0.0
    host, prefetch = np.zeros(S), np.zeros(S)
    np.add.at(host, p.layer_stage, on_host)
    np.maximum.at(prefetch, p.layer_stage, on_host)
    backlog = np.zeros(S)
    if p.offload is not None:
        backlog = np.maximum(0.0, host - p.offload.forward_link_bytes)
    activations, calibrated = np.zeros(S), np.zeros(S)
    np.add.at(activations, p.layer_stage, per_layer)
    np.add.at(calibrated, p.layer_stage, calibration)
    laaq_stage = np.zeros(S, dtype=bool)
    laaq_stage[p.layer_stage[laaq]] = True
    eob = p.end_of_backward_bytes()
    stage = {"activations": activations, "calibration": calibrated,
             "laaq_transient": np.where(laaq_stage, p.laaq_transient(), 0.0), "offload_backlog": backlog,
             "prefetch": prefetch, "top_end_of_backward": eob[p.top_layers()], "nothing": np.zeros(S),
             "offload_backward": np.full(S, 0.0 if p.offload is None else float(p.offload.backward_bytes))}
    held, held_calibration = np.zeros(L), np.zeros(L)
    flight = p.in_flight_counts()
    for l in np.nonzero(ckpt)[0]:
        s = p.layer_stage[l]
        earlier = (p.layer_stage == s) & (np.arange(L) < l)
        held[l] = (flight[s] - 1) / flight[s] * activations[s] + per_layer[earlier].sum() / flight[s] \
            + p.checkpoint_memory[l] / flight[s]
        held_calibration[l] = (flight[s] - 1) / flight[s] * calibrated[s] + calibration[earlier].sum() / flight[s] \
            + calibration[l] / flight[s]
    fetched = np.zeros(L)
    if L > 0:
        fetched[0] = prefetch[p.layer_stage[0]]
    if L > 1:
        fetched[1] = float(np.sort(on_host[off])[-2:].sum())
    layer = {"held": held, "held_calibration": held_calibration, "rerun": p.recomputed(),
             "rerun_calibration": p.rerun_calibrated(), "end_of_backward": eob, "fetched": fetched}
    return Quantities(stage, layer, np.asarray(p.layer_stage), ckpt, off, np.asarray(p.static_bytes, float), host,
                      int(laaq.sum()))


def phase_sum(phase: Phase, static, amount):
    """static + the phase's terms, added in order: `amount(quantity)` a number or array, or a tuple of them added
    one by one (an enumeration's quantity made of several counts' bytes: agoq.search.milp_offload_configs)."""
    value = static
    for term in phase.terms:
        amounts = amount(term.quantity)
        for addend in (amounts if isinstance(amounts, tuple) else (amounts,)):
            value = value + addend
    return value


def phase_value(q: Quantities, phase: Phase, stage: int, layer: Optional[int]) -> float:
    """static_s + the phase's terms, added in order."""
    return phase_sum(phase, q.static[stage], lambda quantity: q.value(quantity, stage, layer))


def evaluate(p, chosen: np.ndarray, ckpt: np.ndarray, offload=None) -> dict:
    """Per stage: the peak (whole bytes, rounded up), the phase that sets it and its layer (`phase`, `layer`), the
    phase itself (`winner`: a Phase, or None for the optimizer step) and the quantities (`q`); also the activations
    at the end of forward, the LAAQ transient, the layers running LAAQ, the bytes on the host, the prefetch reserve,
    the backlog, the offload floor's lift, the largest checkpoint_backward value per stage (`checkpoint_peak`) and
    the offloaded layers' backward level less what their backward allocates (`level_at_offloaded`)."""
    q = quantities(p, chosen, ckpt, offload)
    S = len(q.static)
    mem = np.full(S, -np.inf)
    winner, at_layer = [None] * S, [None] * S
    checkpoint_peak, level_at_offloaded = np.full(S, -np.inf), np.full(S, -np.inf)
    for phase in PHASES:
        for s, l in q.places(phase):
            value = phase_value(q, phase, s, l)
            if phase.at == CHECKPOINTED:
                checkpoint_peak[s] = max(checkpoint_peak[s], value)
            elif phase.layer is not None:
                level_at_offloaded[s] = max(level_at_offloaded[s], value - q.stage["offload_backward"][s])
            if value > mem[s]:
                mem[s], winner[s], at_layer[s] = value, phase, l
    offload_floor = np.zeros(S)
    if p.offload is not None and q.offloaded.any():
        offload_floor = np.maximum(0.0, p.offload.floor_bytes - mem)
        mem = mem + offload_floor
    floor = p.peak_floor()
    for s in np.nonzero(floor > mem)[0]:
        mem[s], winner[s], at_layer[s] = floor[s], None, None
    # whole bytes, rounded up (a fraction of a byte over a budget is over it; 1e-6 absorbs float noise)
    return {"peak": [int(np.ceil(m - 1e-6)) for m in mem], "winner": winner, "layer": at_layer, "q": q,
            "phase": [w.name if w is not None else "optimizer_step" for w in winner],
            "activations": q.stage["activations"], "transient": q.stage["laaq_transient"],
            "laaq_layers": q.laaq_layers, "host": q.host, "reserve": q.stage["prefetch"],
            "backlog": q.stage["offload_backlog"], "offload_floor": offload_floor, "checkpoint_peak": checkpoint_peak,
            "level_at_offloaded": level_at_offloaded}


def phase_parts(q: Quantities, phase: Phase, stage: int, layer: Optional[int], static_parts: dict) -> dict:
    """The memory parts of `phase` at (stage, layer): the static parts, then each term's (its splits apart), in
    SHOWN_ORDER; they add up to the phase's value."""
    parts = {name: float(v[stage]) for name, v in static_parts.items()}
    mine: dict = {}
    for term in phase.terms:
        value = float(q.value(term.quantity, stage, layer))
        for quantity, part, shown in term.splits:
            split = float(q.value(quantity, stage, layer))
            value = value - split
            if shown == ALWAYS or split:
                mine[part] = mine.get(part, parts.get(part, 0.0)) + split
        if term.shown == ALWAYS or value:
            mine[term.part] = mine.get(term.part, parts.get(term.part, 0.0)) + value
    for part in SHOWN_ORDER:
        if part in mine:
            parts[part] = mine[part]
    return parts


def explain(p, chosen: np.ndarray, checkpoint: np.ndarray, offload=None) -> list[tuple]:
    """Per stage: (phase name, its layer, its parts in bytes, the peak), the parts adding up to the peak (before
    rounding to whole bytes): the winning phase's (`phase_parts`) with the offload floor's lift, or the optimizer
    step's own parts (ChoiceProblem.floor_parts)."""
    m = evaluate(p, chosen, checkpoint, offload)
    out = []
    for s in range(len(m["peak"])):
        phase = m["winner"][s]
        if phase is None:
            parts = {name: float(v[s]) for name, v in p.floor_parts.items()}
        else:
            parts = phase_parts(m["q"], phase, s, m["layer"][s], p.static_parts)
            if m["offload_floor"][s] > 0:
                parts["offload_floor"] = float(m["offload_floor"][s])
        out.append((m["phase"][s], m["layer"][s], parts, m["peak"][s]))
    return out


__all__ = ["Term", "Phase", "PHASES", "Quantities", "quantities", "phase_sum", "phase_value", "evaluate",
           "phase_parts", "explain"]
