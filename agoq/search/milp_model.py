"""The exact per-layer choice as a mixed-integer program (scipy.optimize.milp, HiGHS): its matrices, built once
per problem, and its lexicographic solve. `agoq.search.milp.Solver` asks it questions.

Variables: x_i (option i chosen), c_l (layer l checkpointed), u_l (layer l all at 16 bits, so it runs
unmodified), w_l (attention and o_proj_input both at 16, so o_proj's input is shared), z_s (some layer of
stage s runs LAAQ's functions, whose backward holds dequantized copies: the profile's measured
transient). Constraints:

  for each (layer l, kind k):   sum_{i in (l,k)} x_i + c_l = 1
  u_l >= sum_k x_{l,k,16} - (K - 1)          (with u_l <= x_{l,k,16} for every k: u_l is exactly "all at 16"
  u_l <= x_{l,k,16} for every k               wherever memory, the LAAQ transient or the LAAQ layer time
                                              depends on it)
  z_s >= 1 - u_l - c_l  for each layer l of stage s
  w_l <= x_{l,attention,16},  w_l <= x_{l,o_proj,16}      (saves memory, so it is pushed up to them)
  for each stage s:   sum memory + static_s <= budget_s, and the same for the backward of each
                      checkpointed layer (its input and rerun forward on top of the earlier layers)
  optionally:         step seconds <= time cap, where step seconds = base + sum options' seconds
                      + sum_l checkpoint seconds c_l + laaq_layer_seconds x (L - sum_l u_l - sum_l c_l)

With one setting per stage (ChoiceProblem.one_setting_per_stage: compiled plans, whose every distinct layer
setting is a graph to compile), y_{s,k,o} picks each stage's setting of kind k, sum_o y_{s,k,o} = 1, and a layer
under LAAQ's functions takes it: |x_{l,k,o} - y_{s,k,o}| <= u_l + c_l (and x_{l,k,o} <= y_{s,k,o} for o other
than 16: implied, but it tightens the linear relaxation). A stage then compiles at most three graphs
(unmodified, checkpointed, its LAAQ setting).

With offload offered (ChoiceProblem.offload: one stage, a measured host link), o_l (layer l's saved tensors kept in
host memory), g_l (the bytes it offloads, in the memory rows' unit: g_l = o_l x the layer's bytes, exact by the big-M rows below),
h (the largest g_l: backward's first prefetch), e (milliseconds of link time per micro-batch not hidden by the
window), k (bytes not yet copied out when forward ends) and t, s_l (2 t + sum_l s_l bounds the two largest g_l,
exactly at the best t; OffloadPrices):

  o_l + c_l <= 1,   o_{l+1} <= o_l                   (a prefix of layers: first out, last needed back)
  g_l <= bytes_l(x, u, w),   g_l <= M_l o_l,   g_l >= bytes_l(x, u, w) - M_l (1 - o_l)
  h >= g_l,   s_l >= g_l - t,   link_seconds_per_byte x sum_l g_l - e <= window,   sum_l g_l - k <= forward_link_bytes,
  sum_l g_l <= host budget
  memory rows: - g_l (layer l's bytes are on the host), + k at the end of forward; + h at the start of backward
               (one more row: + k, + (the top layer's end_of_backward bytes + backward_bytes) x o_0) and in the
               backward of each checkpointed layer (its row: + h + M c_l <= room + M, M the largest layer's bytes:
               binding only where c_l = 1); the backward of offloaded layers 0 and 1 (two more rows:
               (e_0 + backward_bytes) o_0 + h <= room and (e_1 + backward_bytes + M') o_1 + 2 t + sum_l s_l <=
               room + M', e_l the end_of_backward bytes, M' = 2 M);
  floor:       (floor_bytes - static) o_0 <= budget - static  (a choice that offloads peaks at no less than the
               profile's measured offloading step, OffloadPrices.floor_bytes)
  time: + seconds_per_byte g_l + accum x e + layer_seconds o_l

Objective: gradient error (ties broken by time) or step time (ties broken by error), lexicographically: the
first objective is solved to within FIRST_GAP of its optimum (3e-3 relative: 0.8 ms of the H100 probe's 264 ms
eager step) or, where HiGHS cannot prove that within the time limit it is given (agoq.search.milp.PRIMARY_SECONDS),
the best choice found by then, with `Allocation.gap` the relative gap left; the second is then minimised exactly
(relative gap 1e-7) among the choices that reach the first's value, a set that holds every exact optimum, and among
those the one that changes fewest tensors (quantized or recomputed options, checkpointed layers): where keeping a
tensor as it is costs nothing, it is kept. When the first optimum is zero (zero error at a loose budget) that
second solve is the real trade-off: the least time at zero error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult
from scipy.sparse import coo_matrix

from agoq.activations.policy import KINDS
from agoq.search.problem import ChoiceProblem
from agoq.search.highs import lp_pool, milp
from agoq.search.milp_levels import Levels, count_priced
from agoq.search.milp_offload import Enumeration
from agoq.search.milp_uniform import tie_break

OBJECTIVES = ("error", "time")
CHANGE_WEIGHT = 1e-4  # the second solve's weight of one tensor not kept as it is
GAP = 1e-7  # relative MIP gap of the second objective (the tie-break) and the least peak: optimal
# The first objective's relative MIP gap. HiGHS finds the optimum early and spends the rest proving it: on the H100
# probe profile's smallest budget the eager QuanGrad problem's MILP took 0.39 s at 1e-7 and 0.07 s at 1e-4, with the
# same answer; with an offloaded layer's backward priced, the smallest budget's prefix MILP and its tie-break took
# 0.42 and 0.44 s at 1e-4 and under 0.05 s at 3e-3. 3e-3 of a step is 0.4-0.8 ms, a fraction of what measured steps
# spread (1-5 %): at 40 budgets over four profiles the plans were the same but one, 0.02 ms slower and with less
# error. The tie-break then admits every choice as fast as the one found (every exact optimum among them), and a
# plan shows a gap left only where a time limit stopped the solve (agoq.search.plan_builder).
FIRST_GAP = 3e-3
MIB = float(2**20)


@dataclass
class Allocation:
    """A solved choice: the option index chosen per (layer, kind), checkpointed layers, and its costs."""

    chosen: np.ndarray        # option indices
    checkpoint: np.ndarray    # bool per layer
    peak_bytes_per_stage: list
    step_seconds: float
    grad_error: float
    activation_bytes_per_stage: Optional[list] = None  # what the layers keep (peak less the static part)
    second_gap: float = 0.0   # MIP gap left on the second objective (0: proven optimal)
    gap: float = 0.0          # MIP gap left on the first objective when its time limit stopped it (0: proven)
    offload: Optional[np.ndarray] = None  # bool per layer: saved tensors kept in host memory (None: none)
    host_bytes: int = 0       # what the offloaded layers keep on the host, per micro-batch
    offload_link_seconds: float = 0.0  # the host link's time per micro-batch, out and back

    def offloaded(self) -> np.ndarray:
        return np.zeros(len(self.checkpoint), dtype=bool) if self.offload is None else np.asarray(self.offload, bool)

    def settings(self, problem: ChoiceProblem) -> list[dict]:
        """Per layer: {'checkpoint': bool, 'kinds': {kind: setting}} in Plan form."""
        out = [{"checkpoint": bool(c), "kinds": {k: 16 for k in KINDS}} for c in self.checkpoint]
        for l, off in enumerate(self.offloaded()):
            if off:
                out[l]["offload"] = True
        for i in self.chosen:
            l, kind, opt = int(problem.layer[i]), KINDS[int(problem.kind[i])], problem.option[i]
            out[l]["kinds"][kind] = opt if opt == "recompute" else int(opt)
        return out


class Model:
    """The MILP's matrices for one problem; budgets and objective are filled in per solve."""

    def __init__(self, p: ChoiceProblem):
        self._first: dict = {}  # first-objective results by (budgets, objective, caps, time limit)
        self._no_prefix: dict = {}  # (time cap, error cap) -> [(budget, offloaded prefixes with no relaxed choice)]
        n, L, S = len(p.option), p.num_layers, p.num_stages
        self.p, self.n, self.L, self.S = p, n, L, S
        # y: each stage's one setting of every kind for its layers under LAAQ (p.one_setting_per_stage)
        self.settings_of = {}
        if p.one_setting_per_stage:
            for i in range(n):
                self.settings_of.setdefault((int(p.layer_stage[p.layer[i]]), int(p.kind[i]), p.option[i]),
                                            len(self.settings_of))
        self.offload = p.offload is not None and S == 1 and L > 0
        self.nv = n + 3 * L + S + len(self.settings_of)   # x, c, u, w, z, y
        self.c0, self.u0, self.w0, self.z0 = n, n + L, n + 2 * L, n + 3 * L
        self.y0 = n + 3 * L + S
        self.o0 = self.g0 = self.h = self.e = self.nv  # offload's o, g, h, e, k, t, s follow (when offered)
        if self.offload:
            self.o0, self.g0 = self.nv, self.nv + L
            self.h, self.e, self.k = self.nv + 2 * L, self.nv + 2 * L + 1, self.nv + 2 * L + 2
            self.t, self.s0 = self.nv + 2 * L + 3, self.nv + 2 * L + 4
            self.nv += 3 * L + 4
        laaq = p.laaq_transient()
        rows, cols, vals, lo, hi = [], [], [], [], []
        r = 0
        groups = p.groups()
        self.groups = groups
        for (l, _k), idx in groups.items():
            rows += [r] * (len(idx) + 1)
            cols += list(idx) + [self.c0 + l]
            vals += [1.0] * (len(idx) + 1)
            lo.append(1.0)
            hi.append(1.0)
            r += 1
        is16 = p.keeps_16bit()
        # u_l carries the LAAQ layer time, and frees a layer from its stage's one setting: it must be exact
        timed = p.laaq_layer_seconds != 0.0 or p.one_setting_per_stage
        self.u_exact = timed
        att, oproj = KINDS.index("attention"), KINDS.index("o_proj_input")
        kinds_per_layer = np.zeros(L, dtype=int)
        for (l, _k) in groups:
            kinds_per_layer[l] += 1
        sixteen_by_layer: dict[int, list[int]] = {}
        for i in np.nonzero(is16)[0]:
            sixteen_by_layer.setdefault(int(p.layer[i]), []).append(int(i))
        for l in range(L):
            s16 = sixteen_by_layer.get(l, [])
            unmodified = p.unmodified_extra[l] + (0.0 if p.unmodified_calibration is None else p.unmodified_calibration[l])
            if (unmodified != 0 or timed) and len(s16) == kinds_per_layer[l]:
                rows += [r] * (len(s16) + 1)
                cols += s16 + [self.u0 + l]
                vals += [1.0] * len(s16) + [-1.0]
                lo.append(-np.inf)
                hi.append(kinds_per_layer[l] - 1.0)
                r += 1
            if laaq[p.layer_stage[l]] > 0 or timed or unmodified < 0:
                # u_l = 1 only when every kind is at 16 (the layer runs unmodified), and z_s = 1 when any
                # layer of the stage runs LAAQ's functions: 1 - u_l - c_l <= z_s
                kinds16 = {int(p.kind[i]) for i in s16}
                for i in s16:
                    rows += [r, r]
                    cols += [self.u0 + l, i]
                    vals += [1.0, -1.0]
                    lo.append(-np.inf)
                    hi.append(0.0)
                    r += 1
                if len(kinds16) < kinds_per_layer[l]:  # some kind cannot stay at 16: never unmodified
                    rows += [r]
                    cols += [self.u0 + l]
                    vals += [1.0]
                    lo.append(-np.inf)
                    hi.append(0.0)
                    r += 1
            if laaq[p.layer_stage[l]] > 0:
                rows += [r, r, r]
                cols += [self.u0 + l, self.c0 + l, self.z0 + p.layer_stage[l]]
                vals += [-1.0, -1.0, -1.0]
                lo.append(-np.inf)
                hi.append(-1.0)
                r += 1
            if p.shared_credit[l] > 0:
                for i in s16:
                    if p.kind[i] in (att, oproj):
                        rows += [r, r]
                        cols += [self.w0 + l, i]
                        vals += [1.0, -1.0]
                        lo.append(-np.inf)
                        hi.append(0.0)
                        r += 1
        if self.settings_of:  # one setting per (stage, kind): sum_o y = 1, and |x_i - y| <= u_l + c_l
            by_group: dict = {}
            for (s, k, _o), j in self.settings_of.items():
                by_group.setdefault((s, k), []).append(j)
            for js in by_group.values():
                rows += [r] * len(js)
                cols += [self.y0 + j for j in js]
                vals += [1.0] * len(js)
                lo.append(1.0)
                hi.append(1.0)
                r += 1
            for i in range(n):
                l = int(p.layer[i])
                y = self.y0 + self.settings_of[(int(p.layer_stage[l]), int(p.kind[i]), p.option[i])]
                if not is16[i]:  # implied, but tightens the relaxation: an option not at 16 is its stage's setting
                    rows += [r, r]
                    cols += [i, y]
                    vals += [1.0, -1.0]
                    lo.append(-np.inf)
                    hi.append(0.0)
                    r += 1
                for sign, low, high in ((1.0, 0.0, np.inf), (-1.0, -np.inf, 0.0)):
                    rows += [r] * 4
                    cols += [i, y, self.u0 + l, self.c0 + l]
                    vals += [1.0, -1.0, sign, sign]
                    lo.append(low)
                    hi.append(high)
                    r += 1
        self._rows = (rows, cols, vals, lo, hi, r)
        # which credit variables may be non-zero: only where both 16 options exist
        w_possible = np.zeros(L, dtype=bool)
        for l in range(L):
            kinds16 = {int(p.kind[i]) for i in sixteen_by_layer.get(l, [])}
            w_possible[l] = p.shared_credit[l] > 0 and {att, oproj} <= kinds16
        upper = np.ones(self.nv)
        upper[self.c0:self.c0 + L] = 1.0 if p.allow_checkpoint else 0.0
        upper[self.w0:self.w0 + L] = w_possible.astype(float)
        upper[self.z0:self.z0 + S] = (laaq > 0).astype(float)
        self.integrality = np.ones(self.nv)
        # per-stage memory rows and the time row
        mem = np.zeros((S, self.nv))
        stage_of_opt = p.layer_stage[p.layer]
        np.add.at(mem, (stage_of_opt, np.arange(n)), p.memory)
        mem[p.layer_stage, self.c0 + np.arange(L)] = p.checkpoint_memory + (
            0.0 if p.checkpoint_calibration is None else p.checkpoint_calibration)
        mem[p.layer_stage, self.u0 + np.arange(L)] = p.unmodified_extra + (
            0.0 if p.unmodified_calibration is None else p.unmodified_calibration)
        mem[p.layer_stage, self.w0 + np.arange(L)] = -p.shared_credit
        mem[np.arange(S), self.z0 + np.arange(S)] = laaq
        # memory rows in units that keep coefficients near 1 (HiGHS's numerics and speed), at most a MiB
        self.unit = float(min(MIB, max(1.0, 2.0 ** np.floor(np.log2(max(float(np.abs(mem).max()), 1.0) / 1e3)))))
        if self.offload:  # its bytes variables are in self.unit bytes
            self._offload_rows(mem, upper)
        rows, cols, vals, lo, hi, r = self._rows
        self.structure = LinearConstraint(coo_matrix((vals, (rows, cols)), shape=(r, self.nv)).tocsr(), lo, hi)
        del self._rows
        if not p.one_setting_per_stage:  # each layer's own choice: an option another beats everywhere is never needed
            upper[:n][dominated_options(p)] = 0.0
        self.bounds = Bounds(np.zeros(self.nv), upper)
        self.memory_rows = mem
        # peaks during the backward of each layer that may be checkpointed (see ChoiceProblem.evaluate)
        flight, extra = p.in_flight_counts(), p.recomputed()
        rows_l, stage_l = [], []
        offsets = np.zeros(S + (L if p.allow_checkpoint else 0) + (3 if self.offload else 0))  # bytes per peak row
        reserve_m = float(self.bounds_upper_h) * self.unit if self.offload else 0.0       # beyond static bytes
        if p.allow_checkpoint:
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
        if self.offload:  # the start of backward, where any layer is offloaded (o_0): + h and the top layer's
            start = mem[0].copy()  # end_of_backward bytes (ChoiceProblem), and an offloaded layer's backward on
            start[self.h] = self.unit  # top (backward's fetch-ahead fills the start's level again)
            eob, d = p.end_of_backward_bytes(), float(p.offload.backward_bytes)
            start[self.o0] += float(eob[p.top_layers()[0]]) + d
            rows_l.append(start)
            stage_l.append(0)
            # the backward of offloaded layer 0 (its bytes at most h) and of layer 1 (the two largest offloaded)
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
        self.peak_rows = np.vstack([mem] + rows_l) if rows_l else mem
        self.peak_stage = np.array(list(range(S)) + stage_l)
        self.peak_offset = offsets
        t = np.zeros(self.nv)
        t[:n] = p.seconds
        t[self.c0:self.c0 + L] = p.checkpoint_seconds - p.laaq_layer_seconds
        t[self.u0:self.u0 + L] = -p.laaq_layer_seconds
        if self.offload:
            t[self.g0:self.g0 + L] = self.unit * p.offload.seconds_per_byte
            t[self.e] = 1e-3 * p.offload.grad_accum  # e is in milliseconds
            t[self.o0:self.o0 + L] = p.offload.layer_seconds
        self.time_row = t
        self.time_constant = p.base_seconds + L * p.laaq_layer_seconds  # step seconds = time_constant + t @ x
        self.levels = Levels(self) if count_priced(self) else None  # step time as a count (agoq.search.milp_levels)
        e = np.zeros(self.nv)
        e[:n] = p.error
        self.error_row = e

    def _offload_rows(self, mem: np.ndarray, upper: np.ndarray) -> None:
        """The offload variables' rows (module docstring), their bounds and their memory coefficients."""
        p, L, n, gu = self.p, self.L, self.n, self.unit
        rows, cols, vals, lo, hi, r = self._rows
        o = p.offload
        owner = np.full(self.nv, -1)
        owner[:n] = p.layer
        owner[self.u0:self.u0 + L] = owner[self.w0:self.w0 + L] = np.arange(L)
        biggest = np.zeros(L)  # M_l: the most any choice of layer l keeps
        for (l, _k), idx in self.groups.items():
            biggest[l] += max(0.0, float(mem[0, idx].max()))
        biggest += np.maximum(0.0, mem[0, self.u0:self.u0 + L])
        big = np.maximum(biggest, 1.0)
        scale = max(float(big.max()), 1.0)  # the big-M rows in units of the largest layer: coefficients near 1
        for l in range(L):
            mine = np.nonzero((owner == l) & (mem[0] != 0))[0]
            coef = mem[0, mine] / scale
            g, ol = self.g0 + l, self.o0 + l
            # g_l - bytes_l <= 0
            rows += [r] * (len(mine) + 1); cols += [g] + list(mine); vals += [gu / scale] + list(-coef)  # noqa: E702
            lo.append(-np.inf); hi.append(0.0); r += 1  # noqa: E702
            # g_l - bytes_l - M_l o_l >= -M_l
            rows += [r] * (len(mine) + 2); cols += [g, ol] + list(mine)  # noqa: E702
            vals += [gu / scale, -big[l] / scale] + list(-coef)
            lo.append(-big[l] / scale); hi.append(np.inf); r += 1  # noqa: E702
            # g_l - M_l o_l <= 0
            rows += [r, r]; cols += [g, ol]; vals += [gu / scale, -big[l] / scale]  # noqa: E702
            lo.append(-np.inf); hi.append(0.0); r += 1  # noqa: E702
            # o_l + c_l <= 1
            rows += [r, r]; cols += [ol, self.c0 + l]; vals += [1.0, 1.0]  # noqa: E702
            lo.append(-np.inf); hi.append(1.0); r += 1  # noqa: E702
            # h >= g_l
            rows += [r, r]; cols += [self.h, g]; vals += [1.0, -1.0]  # noqa: E702
            lo.append(0.0); hi.append(np.inf); r += 1  # noqa: E702
            # s_l >= g_l - t (2 t + sum_l s_l >= the two largest g_l, with equality at the best t)
            rows += [r, r, r]; cols += [self.s0 + l, g, self.t]; vals += [1.0, -1.0, 1.0]  # noqa: E702
            lo.append(0.0); hi.append(np.inf); r += 1  # noqa: E702
            if l + 1 < L:  # o_{l+1} <= o_l
                rows += [r, r]; cols += [ol + 1, ol]; vals += [1.0, -1.0]  # noqa: E702
                lo.append(-np.inf); hi.append(0.0); r += 1  # noqa: E702
        g = list(range(self.g0, self.g0 + L))
        # link milliseconds per micro-batch - e <= window milliseconds
        rows += [r] * (L + 1); cols += g + [self.e]  # noqa: E702
        vals += [gu * o.link_seconds_per_byte * 1e3] * L + [-1.0]
        lo.append(-np.inf); hi.append(o.window_seconds * 1e3); r += 1  # noqa: E702
        # bytes not copied out by the end of forward: sum_l g_l - k <= forward_link_bytes
        if np.isfinite(o.forward_link_bytes):
            rows += [r] * (L + 1); cols += g + [self.k]; vals += [1.0] * L + [-1.0]  # noqa: E702
            lo.append(-np.inf); hi.append(max(0.0, o.forward_link_bytes) / gu); r += 1  # noqa: E702
        # host bytes <= budget
        rows += [r] * L; cols += g; vals += [1.0] * L  # noqa: E702
        lo.append(-np.inf); hi.append(max(0.0, o.host_budget_bytes) / gu); r += 1  # noqa: E702
        self._rows = (rows, cols, vals, lo, hi, r)
        upper[self.o0:self.o0 + L] = 1.0
        upper[self.g0:self.g0 + L] = biggest / gu
        upper[self.h] = self.bounds_upper_h = float(biggest.max()) / gu
        upper[self.e] = upper[self.k] = np.inf
        upper[self.t] = upper[self.h]
        upper[self.s0:self.s0 + L] = upper[self.g0:self.g0 + L]
        self.integrality[self.g0:self.g0 + L] = 0
        self.integrality[self.h] = self.integrality[self.e] = self.integrality[self.k] = 0
        self.integrality[self.t] = 0
        self.integrality[self.s0:self.s0 + L] = 0
        mem[0, self.g0:self.g0 + L] = -gu
        mem[0, self.k] = gu  # h counts at the start of backward (the peak rows), not at the end of forward

    def constraints(self, budgets: np.ndarray, time_cap: Optional[float], error_cap: Optional[float] = None) -> list:
        p = self.p
        # memory in self.unit bytes, time in milliseconds: coefficients near 1 keep HiGHS healthy
        room = (np.asarray(budgets, float) - p.static_bytes)[self.peak_stage] - self.peak_offset
        constraints = [self.structure, LinearConstraint(self.peak_rows / self.unit, -np.inf, room / self.unit)]
        if self.offload and p.offload.floor_bytes > 0:  # offloading any layer (o_0) peaks at no less than the floor
            row = np.zeros((1, self.nv))
            row[0, self.o0] = (p.offload.floor_bytes - float(p.static_bytes[0])) / self.unit
            constraints.append(LinearConstraint(row, -np.inf, room[:1] / self.unit))
        if time_cap is not None:
            constraints.append(LinearConstraint(self.time_row[None, :] * 1e3, -np.inf, (time_cap - self.time_constant) * 1e3))
        if error_cap is not None:
            scale = max(float(np.abs(self.error_row).max()), 1e-30)
            constraints.append(LinearConstraint(self.error_row[None, :] / scale, -np.inf, error_cap / scale))
        return constraints

    def rows(self, objective: str):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        return (self.error_row, self.time_row) if objective == "error" else (self.time_row, self.error_row)

    def solve_first_objective(self, budgets: np.ndarray, objective: str, time_cap: Optional[float],
                              time_limit: Optional[float] = None, error_cap: Optional[float] = None):
        """The exact optimum of the first objective (scipy's OptimizeResult; x None when infeasible)."""
        key = (np.asarray(budgets, float).tobytes(), objective, time_cap, time_limit, error_cap)
        if key in self._first:  # solved already (first objective alone, then again with its ties broken)
            return self._first[key]
        if objective == "time" and time_cap is None and self.levels is not None:
            res = self.levels.fastest(budgets, error_cap, time_limit)
            if res is not None:
                return self._keep_first(key, res)
            # the time limit came before a level was settled: the whole MILP, for as long again, keeps its best found
        primary, _ = self.rows(objective)
        scale = max(float(np.abs(primary).max()), 1e-30)
        options = {"mip_rel_gap": FIRST_GAP, **({"time_limit": time_limit} if time_limit else {})}
        args = dict(constraints=self.constraints(budgets, time_cap, error_cap), integrality=self.integrality,
                    bounds=self.bounds)
        if self.offload:  # one MILP per offloaded prefix: each far smaller than the whole (seconds on the probe)
            # a prefix with no relaxed choice at a budget has none at a smaller one (only the memory rows' right-hand
            # sides move with the budget): a front, solved largest budget first, skips them
            budget, known = float(budgets[0]), self._no_prefix.setdefault((time_cap, error_cap), [])
            ruled_out = set().union(*[ks for b, ks in known if b >= budget])
            visit = [k for k in range(self.L + 1) if k not in ruled_out]
            res = self.over_prefixes(primary / scale, args["constraints"], self.bounds, options, time_limit, visit)
            if res is not None:
                known.append((budget, frozenset(visit) - set(res.bounds_by_prefix)))
                del known[:-64]  # a long-lived solver (the dashboard's service) keeps its last answers only
                return self._keep_first(key, res)
        res = milp(primary / scale, options=options, **args)
        if res.x is None and res.status == 1:  # the time limit came before any choice: search on without it
            res = milp(primary / scale, options={"mip_rel_gap": FIRST_GAP}, **args)
        if res.x is None and res.status == 2 and self.offload:
            # HiGHS's presolve can misjudge offload's big-M rows as infeasible where a choice meets them exactly
            # (a budget equal to its peak): asked again without it
            res = milp(primary / scale, options={**options, "presolve": False}, **args)
        return self._keep_first(key, res)

    def over_prefixes(self, c: np.ndarray, constraints: list, bounds: Bounds, options: dict,
                      time_limit: Optional[float], prefixes=None) -> Optional[OptimizeResult]:
        """min c x over the MILP's choices (`constraints`, `bounds`), one offloaded prefix at a time.

        Offload is a prefix (o_{l+1} <= o_l): every choice offloads layers 0..K-1 for one K in 0..L, so the
        optimum is the least of the L + 1 MILPs with the o_l fixed, in which offload's big-M rows are plain
        bounds. Each K's linear relaxation bounds its MILP from below: the prefixes are solved best bound first,
        and one whose bound cannot beat the best found (within the MIP gap) is not solved. As exact as the whole
        MILP (within `options`' mip_rel_gap); seconds faster where layers may each take their own setting (eager
        plans). Where `time_limit` (seconds for them all) stops it, the best choice found by then (status 1,
        `mip_gap` from the least bound not settled); None where it stopped before any choice or HiGHS gave no
        relaxation: the caller then solves the whole MILP. An OptimizeResult with x None and status 2 when no
        prefix has a choice. `prefixes` (None: all) limits the K visited to those known to hold every choice that
        can meet the constraints; the result's `bounds_by_prefix` gives each K's relaxed optimum (K without a
        relaxed choice left out)."""
        start = time.perf_counter()
        gap = float(options.get("mip_rel_gap", GAP))  # a prefix must beat the best found by more than this
        ranked, visits = [], []
        for k in range(self.L + 1) if prefixes is None else sorted(prefixes):
            lb, ub = bounds.lb.copy(), bounds.ub.copy()
            on, off = slice(self.o0, self.o0 + k), slice(self.o0 + k, self.o0 + self.L)
            if (ub[on] < 1).any() or (lb[off] > 0).any():
                continue  # a layer that cannot be offloaded in the prefix, or one that must be above it
            lb[on], ub[on], lb[off], ub[off] = 1.0, 1.0, 0.0, 0.0
            visits.append((k, Bounds(lb, ub)))

        def relax(visit):  # without presolve: half the time of these small LPs (and nothing for it to misjudge)
            return milp(c, constraints=constraints, integrality=np.zeros(self.nv), bounds=visit[1],
                        options={"presolve": False})

        for (k, fixed), relaxed in zip(visits, lp_pool().map(relax, visits)):
            if relaxed.status == 2:
                continue  # not even the relaxation fits: no choice offloads exactly these layers
            if relaxed.x is None:
                return None
            ranked.append((float(c @ relaxed.x), k, fixed))
        best, best_value = None, np.inf
        unsettled = np.inf  # the least bound of a prefix the time limit left unsolved or unproven
        for bound, _k, fixed in sorted(ranked, key=lambda t: (t[0], t[1])):
            if bound >= best_value - gap * abs(best_value):
                break  # neither this prefix nor any after it (their bounds are no lower) can do better
            left = None if time_limit is None else time_limit - (time.perf_counter() - start)
            if left is not None and left <= 0:
                unsettled = min(unsettled, bound)
                break
            opts = {**options, **({"time_limit": left} if left is not None else {})}
            res = milp(c, constraints=constraints, integrality=self.integrality, bounds=fixed, options=opts)
            if res.x is None and res.status == 2:  # as in the whole MILP: presolve can misjudge, asked again
                res = milp(c, constraints=constraints, integrality=self.integrality, bounds=fixed,
                           options={**opts, "presolve": False})
            if res.x is None:
                if res.status == 2:
                    continue
                unsettled = min(unsettled, bound)  # stopped by the time limit before any choice
                break
            if res.status != 0:  # a choice, not proven optimal in time
                unsettled = min(unsettled, bound)
            value = float(c @ self.rounded(res.x))
            if value < best_value:
                best, best_value = res, value
        if best is None:
            if np.isfinite(unsettled):
                return None  # the time limit came before any choice: the caller's whole MILP searches on
            best = OptimizeResult(x=None, status=2, success=False, fun=None, mip_gap=None,
                                  message="no choice fits the budget and the caps (every offloaded prefix checked)")
        elif unsettled < best_value - gap * abs(best_value):  # the best found by the time limit, and its gap
            best.status, best.success = 1, False
            best.mip_gap = float((best_value - unsettled) / max(abs(best_value), 1e-30))
        else:
            best.status, best.success, best.mip_gap = 0, True, 0.0
        best.bounds_by_prefix = {k: bound for bound, k, _ in ranked}
        return best

    def _keep_first(self, key, res):
        if len(self._first) >= 16:
            self._first.pop(next(iter(self._first)))
        self._first[key] = res
        return res

    def value(self, x: np.ndarray, objective: str) -> float:
        return float(self.rows(objective)[0] @ self.rounded(x))

    def rounded(self, x: np.ndarray) -> np.ndarray:
        """A solution with its integer variables rounded (HiGHS returns them within its tolerance)."""
        return np.where(self.integrality > 0, np.round(x), x)

    def solve_second_objective(self, first, budgets: np.ndarray, objective: str, time_cap: Optional[float],
                               tie_limit: Optional[float] = None, error_cap: Optional[float] = None):
        """Among the choices reaching `first`'s optimum, the best second objective, then the least memory."""
        primary, secondary = self.rows(objective)
        best = self.value(first.x, objective)
        sec_scale = max(float(np.abs(secondary).max()), 1e-30)
        changes = np.zeros(self.nv)  # tensors not kept as they are: quantized or recomputed options, checkpointed layers
        changes[:self.n] = ~self.p.keeps_16bit()
        changes[self.c0:self.c0 + self.L] = 1.0
        if self.offload:
            changes[self.o0:self.o0 + self.L] = 1.0  # a layer offloaded
        # HiGHS stops within an absolute gap of 1e-6: the second objective (its largest coefficient 1e3) and the
        # changed tensors (1e-4 each) are scaled so that one changed tensor is well above it
        c = 1e3 * secondary / sec_scale + CHANGE_WEIGHT * changes
        options = {"mip_rel_gap": GAP, **({"time_limit": tie_limit} if tie_limit else {})}
        bounds = self.bounds
        if best <= 0.0 and not (primary < 0).any():  # the optimum uses no option with a primary cost: fix those out
            bounds = Bounds(bounds.lb, np.where(primary > 0, 0.0, bounds.ub))
            extra = []
            if objective == "error":
                time_cap = None  # minimising time among choices the cap allowed: the cap cannot bind
        else:  # ties among the optimum's equals
            seconds = best + self.time_constant
            if objective == "time" and self.levels is not None and self._ties_keep_every_layer(first.x, seconds):
                # compiled, alike layers: enumerated, not searched (agoq.search.milp_uniform)
                quick = tie_break(self, seconds, self.levels.tied_counts(seconds), budgets, error_cap,
                                  1e3 / sec_scale, CHANGE_WEIGHT)
                if quick is not None:
                    quick.second_gap = 0.0
                    return quick
            elif objective == "time" and time_cap is None and self.levels is not None:
                enumeration = Enumeration.build(self)  # alike layers with an offloaded prefix: enumerated too
                quick = None if enumeration is None else enumeration.tie_break(
                    best, budgets, error_cap, 1e3 / sec_scale, CHANGE_WEIGHT)
                if quick is not None:
                    quick.second_gap = 0.0
                    return quick
            scale = max(float(np.abs(primary).max()), 1e-30)
            extra = [LinearConstraint(primary[None, :] / scale, -np.inf, (best + abs(best) * 1e-9 + 1e-12) / scale)]
        # the first answer meets every row here, so its own value bounds the second solve from above: told so, HiGHS
        # prunes from the start (on the H100 probe's smallest budget its time to prove the tie-break varied
        # 0.30-0.66 s with the last bits of the time row's right-hand side; 0.30 s with this row)
        c_scale = max(float(np.abs(c).max()), 1e-30)
        ceiling = float(c @ self.rounded(first.x)) / c_scale
        cutoff = LinearConstraint(c[None, :] / c_scale, -np.inf, ceiling + abs(ceiling) * 1e-9 + 1e-9)
        rows = self.constraints(budgets, time_cap, error_cap) + extra
        cons = rows + [cutoff]
        second = None
        if self.offload:  # the prefixes whose relaxed first objective reaches the optimum hold every tie
            known = getattr(first, "bounds_by_prefix", None)
            if known is not None and extra:
                top = best + abs(best) * 1e-9 + 1e-12
                known = {k for k, bound in known.items() if bound * scale <= top + abs(top) * 1e-6}
            second = self.over_prefixes(c, cons, bounds, options, tie_limit, known if extra else None)
        if second is None:
            second = milp(c, constraints=cons, integrality=self.integrality, bounds=bounds, options=options)
        if second.x is None and second.status == 2:
            # the first answer meets these rows, so "infeasible" is HiGHS's presolve misjudging (seen with offload's
            # big-M rows) or the cutoff's tolerance: solved again without either
            second = milp(c, constraints=rows, integrality=self.integrality, bounds=bounds,
                          options={**options, "presolve": False})
        if second.x is None:  # cannot happen (the first answer is feasible); kept as the answer if it does
            first.second_gap = 1.0
            return first
        second.second_gap = 0.0 if second.status == 0 else float(getattr(second, "mip_gap", 1.0) or 0.0)
        return second

    def _ties_keep_every_layer(self, x: np.ndarray, seconds: float) -> bool:
        """Whether every choice as fast as `x` (`seconds` a step) keeps every layer on the GPU: no offload is
        offered, or `x` offloads nothing and the least offload (layer 0's least bytes) costs more than the tie
        tolerance (faster levels that would have to offload were ruled out by the levels' search)."""
        if not self.offload:
            return True
        if np.round(x[self.o0:self.o0 + self.L]).any():
            return False
        return self.levels.link_seconds(self.levels.first_layer_bytes) > abs(seconds) * 1e-9 + 1e-12

    tie_break = True  # False: the first objective only (its ties left unbroken, second_gap 1)

    def solve(self, budgets: np.ndarray, objective: str, time_cap: Optional[float],
              time_limit: Optional[float] = None, error_cap: Optional[float] = None,
              tie_limit: Optional[float] = None):
        """Lexicographic: the first objective exactly, then the second (see the module docstring)."""
        first = self.solve_first_objective(budgets, objective, time_cap, time_limit, error_cap)
        if first.x is None:
            return first
        if not self.tie_break:
            first.second_gap, first.gap = 1.0, primary_gap(first)
            return first
        res = self.solve_second_objective(first, budgets, objective, time_cap, tie_limit, error_cap)
        res.gap = primary_gap(first)
        return res

    def allocation(self, x: np.ndarray, second_gap: float = 0.0, gap: float = 0.0) -> Allocation:
        x = np.round(x).astype(int)
        chosen = np.nonzero(x[:self.n])[0]
        ckpt = x[self.c0:self.c0 + self.L].astype(bool)
        off = x[self.o0:self.o0 + self.L].astype(bool) if self.offload else None
        if off is not None and not off.any():
            off = None
        figures = self.p.evaluate(chosen, ckpt, off)
        return Allocation(chosen, ckpt, figures["peak_bytes_per_stage"], figures["step_seconds"],
                          figures["grad_error"], figures["activation_bytes_per_stage"], float(second_gap), float(gap),
                          off, figures["host_bytes"], figures["offload_link_seconds"])

    def least_peak(self, time_cap: Optional[float], error_cap: Optional[float],
                   time_limit: Optional[float]) -> Optional[Allocation]:
        """The choice of least peak (the largest stage's), within the caps; None when the caps cannot be met.
        `time_limit` bounds HiGHS's search (its best choice found by then is kept; none found: it searches on)."""
        # minimise t subject to memory_s <= t for every stage (and every backward peak): t is the last variable
        nv = self.nv + 1
        mem = np.hstack([self.peak_rows / self.unit, -np.ones((len(self.peak_stage), 1))])
        rows = self.structure.A.toarray()
        structure = LinearConstraint(np.hstack([rows, np.zeros((rows.shape[0], 1))]), self.structure.lb,
                                     self.structure.ub)
        cons = [structure, LinearConstraint(mem, -np.inf,
                                            -(self.p.static_bytes[self.peak_stage] + self.peak_offset) / self.unit)]
        if self.offload and self.p.offload.floor_bytes > 0:  # offloading any layer: t >= the floor (constraints)
            row = np.zeros((1, nv))
            row[0, self.o0], row[0, -1] = (self.p.offload.floor_bytes - float(self.p.static_bytes[0])) / self.unit, -1.0
            cons.append(LinearConstraint(row, -np.inf, -float(self.p.static_bytes[0]) / self.unit))
        if time_cap is not None:
            cons.append(LinearConstraint(np.append(self.time_row, 0.0)[None, :] * 1e3, -np.inf,
                                         (time_cap - self.time_constant) * 1e3))
        if error_cap is not None:
            scale = max(float(np.abs(self.error_row).max()), 1e-30)
            cons.append(LinearConstraint(np.append(self.error_row, 0.0)[None, :] / scale, -np.inf, error_cap / scale))
        c = np.zeros(nv)
        c[-1] = 1.0
        lb = np.append(self.bounds.lb, 0.0)
        ub = np.append(self.bounds.ub, np.inf)
        integrality = np.append(self.integrality, 0)
        res = milp(c, constraints=cons, integrality=integrality, bounds=Bounds(lb, ub),
                   options={"mip_rel_gap": GAP, **({"time_limit": time_limit} if time_limit else {})})
        if res.x is None and res.status == 1:  # the time limit came before any choice: search on without it
            res = milp(c, constraints=cons, integrality=integrality, bounds=Bounds(lb, ub), options={"mip_rel_gap": GAP})
        if res.x is None:
            return None
        return self.allocation(res.x[:-1], gap=primary_gap(res))

    def relaxed_bound(self, budgets: np.ndarray, objective: str, time_cap: Optional[float],
                      error_cap: Optional[float]) -> Optional[float]:
        """The optimum of the first objective's linear relaxation (every 0/1 variable in [0, 1]): a lower bound on
        the MILP's (see Solver.relaxed_bound); None when no choice fits, -inf when HiGHS gives no answer."""
        if (self.p.peak_floor() > budgets).any():
            return None
        if objective == "time" and time_cap is None and self.levels is not None and not self.offload:
            return self.levels.relaxed(budgets, error_cap)  # (with offload, the relaxation below bounds bytes too)
        primary, _ = self.rows(objective)
        scale = max(float(np.abs(primary).max()), 1e-30)
        res = milp(primary / scale, constraints=self.constraints(budgets, time_cap, error_cap),
                   integrality=np.zeros(self.nv), bounds=self.bounds)
        if res.status == 2:
            return None
        if res.x is None:
            return -np.inf
        value = float(primary @ res.x)
        return value + self.time_constant if objective == "time" else value


def dominated_options(p: ChoiceProblem) -> np.ndarray:
    """[n] bool: options not at 16 that another option of the same (layer, kind), also not at 16, matches or beats
    in bytes, seconds and error, strictly in one of them or listed before it. An option's bytes, seconds and error
    are all it brings to a choice where each layer takes its own setting (whether a layer runs unmodified, or shares
    o_proj's input, depends only on which kinds are at 16), so swapping it for that one changes as many tensors and
    costs no more of anything: the optimum of either objective, and its tie-break, never needs it. (Where a stage
    takes one setting, an option's error differs by layer: agoq.search.milp_uniform prunes those.) On the H100 probe
    profile's eager QuanGrad combination, 303 of 736 options; its MILP at the smallest budget 1.08 -> 0.81 s."""
    out = np.zeros(len(p.option), dtype=bool)
    sixteen = p.keeps_16bit()
    for idx in p.groups().values():
        idx = idx[~sixteen[idx]]
        if len(idx) < 2:
            continue
        b, t, e = p.memory[idx], p.seconds[idx], p.error[idx]
        no_worse = (b[None, :] <= b[:, None]) & (t[None, :] <= t[:, None]) & (e[None, :] <= e[:, None])  # [o, j]
        better = (b[None, :] < b[:, None]) | (t[None, :] < t[:, None]) | (e[None, :] < e[:, None])
        first = np.arange(len(idx))[None, :] < np.arange(len(idx))[:, None]  # j listed before o
        beaten = no_worse & (better | first)
        np.fill_diagonal(beaten, False)
        out[idx[beaten.any(axis=1)]] = True
    return out


def primary_gap(result) -> float:
    """The relative MIP gap a first-objective solve left: 0 when proven optimal, else HiGHS's gap (1: unknown)."""
    if result.status == 0:
        return 0.0
    gap = getattr(result, "mip_gap", None)
    return 1.0 if gap is None or not np.isfinite(gap) else float(gap)
