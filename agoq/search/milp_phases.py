"""The MILP's memory rows, built from the memory phases (agoq.search.memory_phases.PHASES): each phase at each of its
places is a row, the sum of its terms' linear forms in the MILP's variables (agoq.search.milp_rows: x, c, u, w, z,
and with offload o, g, h, t, s, k), so a phase added there is a row here.

Each quantity's form (bytes per unit of the variable; `constant` bytes count where the phase applies):

  activations        x_i: option i's bytes; c_l: layer l's input; u_l: an unmodified layer's surcharge; w_l: - the
                     shared-input credit; g_l: - unit (layer l's bytes on the host are not held)
  calibration        c_l, u_l: the calibration's bytes of a checkpointed / unmodified layer
  laaq_transient     z_s: the stage's transient
  offload_backlog    k: unit (bytes not yet copied out when forward ends)
  prefetch           h: unit (the largest offloaded layer's bytes; 0 where nothing is offloaded)
  fetched            at layer 0: h (as prefetch); at layer 1: 2 t + sum_l s_l (the two largest offloaded layers')
  held               (f_s - 1)/f_s x (activations + calibration) + 1/f_s x the same of the layers below l, and
                     constant: layer l's input and its calibration / f_s. The MILP's layer bytes carry their
                     calibration, so held_calibration's form is empty (counted here)
  rerun              constant: ChoiceProblem.recomputed()_l (its calibration and end_of_backward bytes included)
  end_of_backward, top_end_of_backward, offload_backward   constants
  nothing            empty

A phase applies where a binary says so: a checkpointed layer's where c_l = 1, an offloaded layer's where o_l = 1, the
stage's offloading phases where o_0 = 1 (offload is a prefix); its constant bytes are that binary's coefficient.
A term that may be non-zero where the phase does not apply (h or 2 t + sum_l s_l in a checkpointed layer's backward,
or in offloaded layer 1's while only layer 0 is offloaded) is released there by a big M, its bound: + M on the
binary, and the row's room + M. The end of forward applies always; a checkpointed layer's held bytes, where it is
not checkpointed, are no more than the end of forward's and need no release. A phase whose terms another one at
the same places extends by bytes never negative (backward_start, below offload_backward on its level) needs no
row of its own. Rows come stage by stage at the end of forward, then the checkpointed layers', then the offloaded
ones'; a phase at a layer the problem lacks keeps an empty row (static bytes <= budget).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from agoq.search.memory_phases import CHECKPOINTED, PHASES, STAGE, Phase

NEVER_NEGATIVE = ("offload_backward",)   # quantities a covered phase's extension may add


def covered(phase: Phase) -> bool:
    """Whether a later phase at the same places holds `phase`'s terms and more bytes, never negative ones."""
    for other in PHASES:
        longer = other.terms[:len(phase.terms)] == phase.terms and len(other.terms) > len(phase.terms)
        if longer and (other.at, other.layer, other.offloading) == (phase.at, phase.layer, phase.offloading) \
                and all(t.quantity in NEVER_NEGATIVE for t in other.terms[len(phase.terms):]):
            return True
    return False


class PhaseRows:
    """The forms of the quantities for one `Rows` (agoq.search.milp_rows) with its variables numbered; `unit` None
    leaves out offload's columns (the end of forward's rows before the unit is known)."""

    def __init__(self, rows, unit: Optional[float]):
        self.r, self.p, self.unit = rows, rows.p, unit
        p, r = self.p, rows
        self.laaq = p.laaq_transient()
        self.offload = r.offload and unit is not None
        self.reserve_m = float(r.bounds_upper_h) * unit if self.offload else 0.0   # the most h is, bytes
        self.owner = np.full(r.nv, -1)  # the layer each variable's bytes belong to
        self.owner[:r.n] = p.layer
        self.owner[r.c0:r.c0 + r.L] = self.owner[r.u0:r.u0 + r.L] = self.owner[r.w0:r.w0 + r.L] = np.arange(r.L)
        if self.offload:
            self.owner[r.g0:r.g0 + r.L] = np.arange(r.L)
        self.layer_bytes = [self.form("activations", s, None)[0] + self.form("calibration", s, None)[0]
                            for s in range(r.S)]

    def zeros(self) -> np.ndarray:
        return np.zeros(self.r.nv)

    def form(self, quantity: str, s: int, l: Optional[int]) -> tuple:
        """(row [variables], constant bytes, bound) of `quantity` at stage s (layer l); `bound`: None, or the most
        bytes of a term that is 0 where nothing is offloaded (h, 2 t + sum_l s_l), which a phase that applies by
        another binary than o_0 releases by that big M."""
        p, r, row = self.p, self.r, self.zeros()
        mine = p.layer_stage == s
        at = np.nonzero(mine)[0]
        constant, bound = 0.0, None
        if quantity == "activations":
            opts = np.nonzero(p.layer_stage[p.layer] == s)[0]
            row[opts] = p.memory[opts]
            row[r.c0 + at], row[r.u0 + at] = p.checkpoint_memory[mine], p.unmodified_extra[mine]
            row[r.w0 + at] = -p.shared_credit[mine]
            if self.offload and s == 0:
                row[r.g0:r.g0 + r.L] = -self.unit
        elif quantity == "calibration":
            if p.checkpoint_calibration is not None:
                row[r.c0 + at] = p.checkpoint_calibration[mine]
            if p.unmodified_calibration is not None:
                row[r.u0 + at] = p.unmodified_calibration[mine]
        elif quantity == "laaq_transient":
            row[r.z0 + s] = self.laaq[s]
        elif quantity == "held":
            f = p.in_flight_counts()[s]
            earlier = (self.owner >= 0) & (self.owner < l) & (p.layer_stage[np.maximum(self.owner, 0)] == s)
            row = self.layer_bytes[s] * (f - 1) / f + np.where(earlier, self.layer_bytes[s] / f, 0.0)
            own = p.checkpoint_memory[l] + (0.0 if p.checkpoint_calibration is None else p.checkpoint_calibration[l])
            constant = own / f
        elif not self.offload:
            constant = self._constant(quantity, s, l)
        elif quantity == "offload_backlog":
            row[r.k] = self.unit
        elif quantity == "prefetch" or (quantity == "fetched" and l == 0):
            row[r.h], bound = self.unit, self.reserve_m
        elif quantity == "fetched":
            row[r.t], row[r.s0:r.s0 + r.L], bound = 2.0 * self.unit, self.unit, 2.0 * self.reserve_m
        else:
            constant = self._constant(quantity, s, l)
        return row, constant, bound

    def _constant(self, quantity: str, s: int, l: Optional[int]) -> float:
        p = self.p
        if quantity == "rerun":
            return float(p.recomputed()[l])
        if quantity == "end_of_backward":
            return float(p.end_of_backward_bytes()[l])
        if quantity == "top_end_of_backward":
            return float(p.end_of_backward_bytes()[p.top_layers()[s]])
        if quantity == "offload_backward":
            return float(p.offload.backward_bytes) if p.offload is not None else 0.0
        return 0.0

    def binary(self, phase: Phase, l: Optional[int]) -> Optional[int]:
        """The variable that says where `phase` applies (None: always)."""
        r = self.r
        if phase.at == CHECKPOINTED:
            return r.c0 + l
        if phase.at == STAGE:
            return r.o0 if phase.offloading else None
        return r.o0 + l

    def row(self, phase: Phase, s: int, l: Optional[int]) -> tuple:
        """(row, offset): the phase's bytes at (s, l) as a row, and what its room gains (- the big M)."""
        if l is not None and l >= self.r.L:
            return self.zeros(), 0.0
        row, constant, big = self.zeros(), 0.0, 0.0
        b = self.binary(phase, l)
        for term in phase.terms:
            vector, c, bound = self.form(term.quantity, s, l)
            row, constant = row + vector, constant + c
            if bound is not None and b != self.r.o0:  # not 0 where the phase does not apply: released there
                big = big + bound
        if b is None:
            return row, 0.0
        row[b] += constant
        if big:
            row[b] += big
        return row, -big

    def places(self, phase: Phase) -> list:
        """(stage, layer) the MILP gives `phase` a row at."""
        r, p = self.r, self.p
        if phase.offloading and not self.offload:
            return []
        if phase.at == STAGE:
            return [(s, None) for s in range(r.S)] if not phase.offloading else [(0, None)]
        if phase.at == CHECKPOINTED:
            return [(int(p.layer_stage[l]), l) for l in range(r.L)] if p.allow_checkpoint else []
        return [(0, phase.layer)]


def forward_rows(rows, unit: Optional[float]) -> np.ndarray:
    """[stages, variables]: the end of forward (the first phase) of every stage."""
    built = PhaseRows(rows, unit)
    return np.array([built.row(PHASES[0], s, None)[0] for s in range(rows.S)]).reshape(rows.S, rows.nv)


def peak_rows(rows) -> tuple:
    """(rows [rows, variables], stage of each, offset of each: bytes its room gains) of every phase but the end of
    forward (`forward_rows`), in the order of the module docstring."""
    built = PhaseRows(rows, rows.unit)
    order = sorted(PHASES[1:], key=lambda ph: (ph.at != CHECKPOINTED, PHASES.index(ph)))
    out, stages, offsets = [], [], []
    for phase in order:
        if covered(phase):
            continue
        for s, l in built.places(phase):
            row, offset = built.row(phase, s, l)
            out.append(row)
            stages.append(s)
            offsets.append(offset)
    return out, stages, offsets


def floor_rows(rows) -> np.ndarray:
    """[rows, variables]: the floors the MILP states beside the phases, in bytes beyond the stage's static bytes (its
    room): an offloading choice (o_0) peaks at no less than OffloadPrices.floor_bytes (memory_phases.evaluate's
    offload floor). The optimizer step's floor is a least budget, checked before any solve (agoq.search.milp)."""
    p = rows.p
    if not rows.offload or p.offload.floor_bytes <= 0:
        return np.zeros((0, rows.nv))
    row = np.zeros((1, rows.nv))
    row[0, rows.o0] = p.offload.floor_bytes - float(p.static_bytes[0])
    return row
