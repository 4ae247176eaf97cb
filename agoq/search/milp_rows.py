"""The per-layer choice's mixed-integer program, as matrices: its variables, its constraint rows, and the memory,
time and error rows that budgets and objectives are set against. Built once per problem (`Rows`);
agoq.search.milp_model's Model solves it.

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

Gradient error: sum_i error_i x_i + sum_q t_q p_q, with one continuous p_q in [0, 1] per pair q of options whose
joint choice adds t_q > 0 (ChoiceProblem.pair_options: a recompute option r and a quantized option b of its source
kind in the same layer, agoq.search.recompute_error), and

  p_q <= x_b,   sum_{q of r} p_q >= x_r - sum_{o of S not paired with r} x_o - c_l     (S: r's source kind)

Where r is chosen its layer is not checkpointed and S's one option is 16, unpaired, or the b of one of r's pairs, so
the second row asks sum_q p_q >= x_b of that pair, and the first bounds every other p_q by its x_b = 0: p_q >= the
product x_r x_b, and no p_q need be more. With S's row (sum_{o of S} x_o + c_l = 1) the two rows give
p_q >= x_r + x_b - 1 (the product's usual bound) and more in the linear relaxation (x_r = 1/2 with two of S's
options at 1/2 each: p_q >= 1/2 in all, where that bound gives 0 each); plan requests on two H200 probe profiles at
their tightest budgets took 1.8 s with these rows, 2.3-2.9 s with that bound instead (2-core CPU). p_q appears in
the error only, with t_q > 0, so where the error is minimised it settles at the product, and under an error cap any
p_q above it only tightens the cap; `rounded` sets it to the product. A pair with an option that can never be chosen
(`dominated_options`) has no variable. One variable per recompute option instead (E_r >= sum_b t_rb x_b - T_r (1 - x_r),
T_r its largest t_rb) was tried: 48 variables against 288 on the probe, but a weaker relaxation; its tightest
requests took 1.2 s against 1.4 s on one H200 profile and 2.2 s against 1.4 s on the H100 one.

The memory rows (the end of forward, each checkpointed layer's backward, offload's start of backward and offloaded
layers' backward) are built from the memory phases, each phase's terms as linear forms in these variables
(agoq.search.milp_phases, from agoq.search.memory_phases.PHASES): a phase added there is a row here.

Memory rows are in `Rows.unit` bytes and the time row in seconds (scaled to milliseconds where it is a constraint):
coefficients near 1 keep HiGHS's numerics and speed.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint
from scipy.sparse import coo_matrix

from agoq.runtime.activations.policy import KINDS
from agoq.search.milp_phases import floor_rows, forward_rows, peak_rows
from agoq.search.problem import ChoiceProblem, read_only

OBJECTIVES = ("error", "time")
MIB = float(2**20)


class _RowBuilder:
    """Sparse constraint rows, one at a time: lo <= sum_j vals_j x[cols_j] <= hi."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.lo, self.hi, self.r = [], [], [], [], [], 0

    def add(self, cols: list, vals: list, lo: float, hi: float) -> None:
        self.rows += [self.r] * len(cols)
        self.cols += list(cols)
        self.vals += list(vals)
        self.lo.append(lo)
        self.hi.append(hi)
        self.r += 1

    def matrix(self, nv: int) -> LinearConstraint:
        return LinearConstraint(coo_matrix((self.vals, (self.rows, self.cols)), shape=(self.r, nv)).tocsr(),
                                self.lo, self.hi)


class Rows:
    """The MILP's variables and matrices for one problem; budgets and objective are filled in per solve."""

    def __init__(self, p: ChoiceProblem):
        """The rows of `p`, built once per problem (ChoiceProblem.derived) and shared, read-only, by its solvers."""
        self.__dict__.update(p.derived("milp_rows", lambda: self._built(p)))

    def _built(self, p: ChoiceProblem) -> dict:
        self._build(p)
        read_only(vars(self))
        return dict(vars(self))

    def _build(self, p: ChoiceProblem) -> None:
        n, L, S = len(p.option), p.num_layers, p.num_stages
        self.p, self.n, self.L, self.S = p, n, L, S
        # each layer's own choice: an option another beats everywhere is never needed (bounded to 0 below)
        never = dominated_options(p) if not p.one_setting_per_stage else np.zeros(n, dtype=bool)
        self._number_variables(never)
        laaq = p.laaq_transient()
        built = _RowBuilder()
        self.groups = p.groups()
        for (l, _k), idx in self.groups.items():  # one option per (layer, kind), or the layer checkpointed
            built.add(list(idx) + [self.c0 + l], [1.0] * (len(idx) + 1), 1.0, 1.0)
        sixteen = _sixteen_by_layer(p)
        self._layer_rows(built, laaq, sixteen)
        if self.settings_of:
            self._setting_rows(built)
        if self.nq:
            self._pair_rows(built, never)
        upper = self._upper_bounds(laaq, sixteen)
        self.integrality = np.ones(self.nv)
        self.integrality[self.q0:self.q0 + self.nq] = 0
        mem = forward_rows(self, None)  # the end of forward, without offload's columns
        # memory rows in units that keep coefficients near 1 (HiGHS's numerics and speed), at most a MiB
        self.unit = float(min(MIB, max(1.0, 2.0 ** np.floor(np.log2(max(float(np.abs(mem).max()), 1.0) / 1e3)))))
        if self.offload:  # its bytes variables are in self.unit bytes
            self._offload_rows(built, mem, upper)
            mem = forward_rows(self, self.unit)
        self.structure = built.matrix(self.nv)
        upper[:n][never] = 0.0
        self.bounds = Bounds(np.zeros(self.nv), upper)
        self.memory_rows = mem  # [stages, variables]: the end of forward (agoq.search.milp_phases)
        rows, stages, offsets = peak_rows(self)  # every other phase's rows
        self.peak_rows = np.vstack([mem] + rows)
        self.peak_stage = np.array(list(range(S)) + stages)
        self.peak_offset = np.array([0.0] * S + offsets)  # bytes each row's room gains (- its big M)
        self.floor_rows = floor_rows(self)  # [rows, variables], bytes beyond stage 0's static bytes
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
        e = np.zeros(self.nv)
        e[:n] = p.error
        e[self.q0:self.q0 + self.nq] = self.pair_t
        self.error_row = e

    def _number_variables(self, never: np.ndarray) -> None:
        """The variables' positions: x, c, u, w, z, y, then offload's o, g, h, e, k, t, s (when offered), then the
        pairs' p (those whose options can both be chosen: not `never`)."""
        p, n, L, S = self.p, self.n, self.L, self.S
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
        pairs, error = p.pairs()
        live = (error > 0) & ~never[pairs[:, 0]] & ~never[pairs[:, 1]]
        self.pair_x, self.pair_t = pairs[live], error[live]  # [q, 2] option indices, [q] their error
        self.q0, self.nq = self.nv, int(live.sum())
        self.nv += self.nq

    def _layer_rows(self, built: _RowBuilder, laaq: np.ndarray, sixteen_by_layer: dict) -> None:
        """Per layer: u_l (all at 16), z_s (its stage runs LAAQ's functions) and w_l (o_proj's input shared)."""
        p, L = self.p, self.L
        # u_l carries the LAAQ layer time, and frees a layer from its stage's one setting: it must be exact
        timed = p.laaq_layer_seconds != 0.0 or p.one_setting_per_stage
        self.u_exact = timed
        att, oproj = KINDS.index("attention"), KINDS.index("o_proj_input")
        kinds_per_layer = np.zeros(L, dtype=int)
        for (l, _k) in self.groups:
            kinds_per_layer[l] += 1
        for l in range(L):
            s16 = sixteen_by_layer.get(l, [])
            unmodified = p.unmodified_extra[l] + (0.0 if p.unmodified_calibration is None else p.unmodified_calibration[l])
            if (unmodified != 0 or timed) and len(s16) == kinds_per_layer[l]:
                built.add(s16 + [self.u0 + l], [1.0] * len(s16) + [-1.0], -np.inf, kinds_per_layer[l] - 1.0)
            if laaq[p.layer_stage[l]] > 0 or timed or unmodified < 0:
                # u_l = 1 only when every kind is at 16 (the layer runs unmodified), and z_s = 1 when any
                # layer of the stage runs LAAQ's functions: 1 - u_l - c_l <= z_s
                kinds16 = {int(p.kind[i]) for i in s16}
                for i in s16:
                    built.add([self.u0 + l, i], [1.0, -1.0], -np.inf, 0.0)
                if len(kinds16) < kinds_per_layer[l]:  # some kind cannot stay at 16: never unmodified
                    built.add([self.u0 + l], [1.0], -np.inf, 0.0)
            if laaq[p.layer_stage[l]] > 0:
                built.add([self.u0 + l, self.c0 + l, self.z0 + p.layer_stage[l]], [-1.0, -1.0, -1.0], -np.inf, -1.0)
            if p.shared_credit[l] > 0:
                for i in s16:
                    if p.kind[i] in (att, oproj):
                        built.add([self.w0 + l, i], [1.0, -1.0], -np.inf, 0.0)

    def _pair_rows(self, built: _RowBuilder, never: np.ndarray) -> None:
        """Each pair's p at the product of its two options (module docstring): p_q <= x_b, and per recompute option r,
        sum_q p_q >= x_r - (its source's other options, 16 among them, and the layer's checkpoint)."""
        p = self.p
        by_recompute: dict[int, list[int]] = {}
        for q, (r, b) in enumerate(self.pair_x):
            built.add([self.q0 + q, int(b)], [1.0, -1.0], -np.inf, 0.0)
            by_recompute.setdefault(int(r), []).append(q)
        for r, qs in by_recompute.items():
            l, paired = int(p.layer[r]), {int(self.pair_x[q, 1]) for q in qs}
            source = self.groups[(l, int(p.kind[self.pair_x[qs[0], 1]]))]
            others = [int(i) for i in source if int(i) not in paired and not never[i]]
            built.add([self.q0 + q for q in qs] + [r] + others + [self.c0 + l],
                      [1.0] * len(qs) + [-1.0] + [1.0] * (len(others) + 1), 0.0, np.inf)

    def _setting_rows(self, built: _RowBuilder) -> None:
        """One setting per (stage, kind): sum_o y = 1, and |x_i - y| <= u_l + c_l."""
        p = self.p
        is16 = p.keeps_16bit()
        by_group: dict = {}
        for (s, k, _o), j in self.settings_of.items():
            by_group.setdefault((s, k), []).append(j)
        for js in by_group.values():
            built.add([self.y0 + j for j in js], [1.0] * len(js), 1.0, 1.0)
        for i in range(self.n):
            l = int(p.layer[i])
            y = self.y0 + self.settings_of[(int(p.layer_stage[l]), int(p.kind[i]), p.option[i])]
            if not is16[i]:  # implied, but tightens the relaxation: an option not at 16 is its stage's setting
                built.add([i, y], [1.0, -1.0], -np.inf, 0.0)
            for sign, low, high in ((1.0, 0.0, np.inf), (-1.0, -np.inf, 0.0)):
                built.add([i, y, self.u0 + l, self.c0 + l], [1.0, -1.0, sign, sign], low, high)

    def _upper_bounds(self, laaq: np.ndarray, sixteen_by_layer: dict) -> np.ndarray:
        """Every variable's upper bound (offload's are set with its rows)."""
        p, L, S = self.p, self.L, self.S
        att, oproj = KINDS.index("attention"), KINDS.index("o_proj_input")
        # which credit variables may be non-zero: only where both 16 options exist
        w_possible = np.zeros(L, dtype=bool)
        for l in range(L):
            kinds16 = {int(p.kind[i]) for i in sixteen_by_layer.get(l, [])}
            w_possible[l] = p.shared_credit[l] > 0 and {att, oproj} <= kinds16
        upper = np.ones(self.nv)
        upper[self.c0:self.c0 + L] = 1.0 if p.allow_checkpoint else 0.0
        upper[self.w0:self.w0 + L] = w_possible.astype(float)
        upper[self.z0:self.z0 + S] = (laaq > 0).astype(float)
        return upper

    def _offload_rows(self, built: _RowBuilder, mem: np.ndarray, upper: np.ndarray) -> None:
        """The offload variables' rows (module docstring), their bounds and their memory coefficients."""
        p, L, n, gu = self.p, self.L, self.n, self.unit
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
            built.add([g] + list(mine), [gu / scale] + list(-coef), -np.inf, 0.0)  # g_l - bytes_l <= 0
            # g_l - bytes_l - M_l o_l >= -M_l
            built.add([g, ol] + list(mine), [gu / scale, -big[l] / scale] + list(-coef), -big[l] / scale, np.inf)
            built.add([g, ol], [gu / scale, -big[l] / scale], -np.inf, 0.0)  # g_l - M_l o_l <= 0
            built.add([ol, self.c0 + l], [1.0, 1.0], -np.inf, 1.0)  # o_l + c_l <= 1
            built.add([self.h, g], [1.0, -1.0], 0.0, np.inf)  # h >= g_l
            # s_l >= g_l - t (2 t + sum_l s_l >= the two largest g_l, with equality at the best t)
            built.add([self.s0 + l, g, self.t], [1.0, -1.0, 1.0], 0.0, np.inf)
            if l + 1 < L:  # o_{l+1} <= o_l
                built.add([ol + 1, ol], [1.0, -1.0], -np.inf, 0.0)
        g = list(range(self.g0, self.g0 + L))
        # link milliseconds per micro-batch - e <= window milliseconds
        built.add(g + [self.e], [gu * o.link_seconds_per_byte * 1e3] * L + [-1.0], -np.inf, o.window_seconds * 1e3)
        # bytes not copied out by the end of forward: sum_l g_l - k <= forward_link_bytes
        if np.isfinite(o.forward_link_bytes):
            built.add(g + [self.k], [1.0] * L + [-1.0], -np.inf, max(0.0, o.forward_link_bytes) / gu)
        built.add(g, [1.0] * L, -np.inf, max(0.0, o.host_budget_bytes) / gu)  # host bytes <= budget
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

    def constraints(self, budgets: np.ndarray, time_cap: Optional[float], error_cap: Optional[float] = None) -> list:
        p = self.p
        # memory in self.unit bytes, time in milliseconds: coefficients near 1 keep HiGHS healthy
        room = (np.asarray(budgets, float) - p.static_bytes)[self.peak_stage] - self.peak_offset
        constraints = [self.structure, LinearConstraint(self.peak_rows / self.unit, -np.inf, room / self.unit)]
        if len(self.floor_rows):  # offloading any layer (o_0) peaks at no less than the floor
            constraints.append(LinearConstraint(self.floor_rows / self.unit, -np.inf, room[:1] / self.unit))
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

    def value(self, x: np.ndarray, objective: str) -> float:
        return float(self.rows(objective)[0] @ self.rounded(x))

    def rounded(self, x: np.ndarray) -> np.ndarray:
        """A solution with its integer variables rounded (HiGHS returns them within its tolerance) and each pair's p
        at the product of its two options (no more error than the choice has). Columns after the model's own (the
        least peak's bound) are kept as they are."""
        x = np.asarray(x, float).copy()
        x[:self.nv] = np.where(self.integrality > 0, np.round(x[:self.nv]), x[:self.nv])
        if self.nq:
            x[self.q0:self.q0 + self.nq] = np.maximum(0.0, x[self.pair_x[:, 0]] + x[self.pair_x[:, 1]] - 1.0)
        return x


def _sixteen_by_layer(p: ChoiceProblem) -> dict[int, list[int]]:
    """layer -> the indices of its options at 16 bits."""
    out: dict[int, list[int]] = {}
    for i in np.nonzero(p.keeps_16bit())[0]:
        out.setdefault(int(p.layer[i]), []).append(int(i))
    return out


def dominated_options(p: ChoiceProblem) -> np.ndarray:
    """[n] bool: options not at 16 that another option of the same (layer, kind), also not at 16, matches or beats
    in bytes, seconds and error, strictly in one of them or listed before it. An option's bytes, seconds and error
    are all it brings to a choice where each layer takes its own setting (whether a layer runs unmodified, or shares
    o_proj's input, depends only on which kinds are at 16), so swapping it for that one changes as many tensors and
    costs no more of anything: the optimum of either objective, and its tie-break, never needs it. (Where a stage
    takes one setting, an option's error differs by layer: agoq.search.milp_uniform prunes those.) On the H100 probe
    profile's eager QuanGrad combination, 303 of 736 options; its MILP at the smallest budget 1.08 -> 0.81 s.

    Pairs (ChoiceProblem.pair_options) make an option's error depend on another kind's choice: a recompute option
    brings between its own error (the source at 16) and that plus its largest pair's, so it beats another option
    only with the largest, and is beaten by its own alone; a source's quantized option also brings each recompute
    of its kind its pair's error, so it beats another only where each of those is no larger too. "Strictly" is then:
    where the other is not as good the other way round (with ranges, two options can be no worse than each other
    only where both are one value and equal)."""
    out = np.zeros(len(p.option), dtype=bool)
    sixteen = p.keeps_16bit()
    low, high, carried = pair_bounds(p)
    for group, idx in p.groups().items():
        idx = idx[~sixteen[idx]]
        if len(idx) < 2:
            continue
        b, t, lo, hi = p.memory[idx], p.seconds[idx], low[idx], high[idx]
        no_worse = (b[None, :] <= b[:, None]) & (t[None, :] <= t[:, None]) & (hi[None, :] <= lo[:, None])  # [o, j]
        back = (b[:, None] <= b[None, :]) & (t[:, None] <= t[None, :]) & (hi[:, None] <= lo[None, :])  # o as good
        for c in carried.get(group, ()):  # [n] the error option j brings one recompute: no more than o's
            v = c[idx]
            no_worse &= v[None, :] <= v[:, None]
            back &= v[:, None] <= v[None, :]
        first = np.arange(len(idx))[None, :] < np.arange(len(idx))[:, None]  # j listed before o
        beaten = no_worse & (~back | first)  # j no worse, and better somewhere or the same and listed first
        np.fill_diagonal(beaten, False)
        out[idx[beaten.any(axis=1)]] = True
    return out


def pair_bounds(p: ChoiceProblem) -> tuple[np.ndarray, np.ndarray, dict]:
    """Per option, the least and the most error it brings whatever the other kinds' choice ([n], [n]: its own error,
    and for a recompute option its own plus its largest pair's), and per source's (layer, kind index) a list with, for
    each recompute option paired with its options, [n] the error each option brings that recompute (its pair's, else
    0)."""
    low = np.asarray(p.error, float)
    high = low.copy()
    pairs, error = p.pairs()
    carried: dict = {}
    for (r, b), e in zip(pairs, error):
        high[r] = max(high[r], low[r] + e)
        mine = carried.setdefault((int(p.layer[b]), int(p.kind[b])), {})
        mine.setdefault(int(r), np.zeros(len(low)))[b] = e
    return low, high, {group: list(by_r.values()) for group, by_r in carried.items()}
