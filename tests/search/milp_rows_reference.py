"""The MILP's memory rows as they were written before agoq.search.milp_phases built them from the memory phases:
the reference that tests/search/test_memory_phases.py holds the phases' rows to (kept here, in the tests only).
Each function takes the `Rows` (agoq.search.milp_rows) as `self`; `old_peak_rows` sets `reference_rows`,
`reference_stage` and `reference_offset` on it."""

from __future__ import annotations

import numpy as np


def old_memory_matrix(self, laaq: np.ndarray) -> np.ndarray:
    """[stages, variables]: the bytes each variable adds to its stage's activation memory."""
    p, n, L, S = self.p, self.n, self.L, self.S
    mem = np.zeros((S, self.nv))
    stage_of_opt = p.layer_stage[p.layer]
    np.add.at(mem, (stage_of_opt, np.arange(n)), p.memory)
    mem[p.layer_stage, self.c0 + np.arange(L)] = p.checkpoint_memory + (
        0.0 if p.checkpoint_calibration is None else p.checkpoint_calibration)
    mem[p.layer_stage, self.u0 + np.arange(L)] = p.unmodified_extra + (
        0.0 if p.unmodified_calibration is None else p.unmodified_calibration)
    mem[p.layer_stage, self.w0 + np.arange(L)] = -p.shared_credit
    mem[np.arange(S), self.z0 + np.arange(S)] = laaq
    return mem


def old_peak_rows(self, mem: np.ndarray, laaq: np.ndarray) -> None:
    """peak_rows [rows, variables], peak_stage and peak_offset (bytes): every stage's memory at the end of
    forward (`mem`), then its peaks during the backward of each layer that may be checkpointed (see
    ChoiceProblem.evaluate) and, with offload, at the start of backward and in offloaded layers' backward."""
    p, S, L = self.p, self.S, self.L
    rows_l, stage_l = [], []
    offsets = np.zeros(S + (L if p.allow_checkpoint else 0) + (3 if self.offload else 0))  # bytes per peak row
    reserve_m = float(self.bounds_upper_h) * self.unit if self.offload else 0.0       # beyond static bytes
    if p.allow_checkpoint:
        _checkpoint_peaks(self, mem, laaq, reserve_m, rows_l, stage_l, offsets)
    if self.offload:
        _offload_peaks(self, mem, reserve_m, rows_l, stage_l, offsets)
    self.reference_rows = np.vstack([mem] + rows_l) if rows_l else mem
    self.reference_stage = np.array(list(range(S)) + stage_l)
    self.reference_offset = offsets


def _checkpoint_peaks(self, mem: np.ndarray, laaq: np.ndarray, reserve_m: float, rows_l: list, stage_l: list,
                      offsets: np.ndarray) -> None:
    """The backward of each checkpointed layer: its input and rerun forward on top of the earlier layers."""
    p, n, L, S = self.p, self.n, self.L, self.S
    flight, extra = p.in_flight_counts(), p.recomputed()
    owner = np.full(self.nv, -1)
    owner[:n] = p.layer
    owner[self.c0:self.c0 + L] = owner[self.u0:self.u0 + L] = owner[self.w0:self.w0 + L] = np.arange(L)
    if self.offload:
        owner[self.g0:self.g0 + L] = np.arange(L)  # an earlier layer's bytes on the host are not held
    for l in range(L):
        s = p.layer_stage[l]
        row = mem[s] * (flight[s] - 1) / flight[s]
        earlier = (owner >= 0) & (owner < l) & (p.layer_stage[np.maximum(owner, 0)] == s)
        row = row + np.where(earlier, mem[s] / flight[s], 0.0)
        own = p.checkpoint_memory[l] + (0.0 if p.checkpoint_calibration is None else p.checkpoint_calibration[l])
        row[self.c0 + l] += own / flight[s] + extra[l]
        row[self.z0 + s] = laaq[s]
        if self.offload:  # + h where l is checkpointed: h + M c_l <= room + M (M: h's upper bound)
            row[self.h] = self.unit
            row[self.c0 + l] += reserve_m
            offsets[len(rows_l) + S] = -reserve_m
        rows_l.append(row)
        stage_l.append(s)


def _offload_peaks(self, mem: np.ndarray, reserve_m: float, rows_l: list, stage_l: list,
                   offsets: np.ndarray) -> None:
    """The start of backward, where any layer is offloaded (o_0): + h and the top layer's end_of_backward bytes
    (ChoiceProblem), and an offloaded layer's backward on top (backward's fetch-ahead fills the start's level
    again); then the backward of offloaded layer 0 (its bytes at most h) and of layer 1 (the two largest
    offloaded)."""
    p, L, S = self.p, self.L, self.S
    start = mem[0].copy()
    start[self.h] = self.unit
    eob, d = p.end_of_backward_bytes(), float(p.offload.backward_bytes)
    start[self.o0] += float(eob[p.top_layers()[0]]) + d
    rows_l.append(start)
    stage_l.append(0)
    at0 = np.zeros(self.nv)
    at0[self.o0], at0[self.h] = float(eob[0]) + d, self.unit
    rows_l.append(at0)
    stage_l.append(0)
    at1 = np.zeros(self.nv)
    if L > 1:  # binding only where o_1 = 1: + M o_1 <= room + M, M the most 2 t + sum_l s_l needs
        big = 2.0 * reserve_m
        at1[self.o0 + 1], at1[self.t] = float(eob[1]) + d + big, 2.0 * self.unit
        at1[self.s0:self.s0 + L] = self.unit
        offsets[len(rows_l) + S] = -big
    rows_l.append(at1)
    stage_l.append(0)
