"""Where a prefix of alike layers may be offloaded: a configuration's amounts, for agoq.search.milp_offload's
enumeration (`Configurations`: the per-model constants, every configuration and its bound, its memory rows, its
least error and the model's variables of its choice).


The structure of agoq.search.milp_uniform (a compiled plan of one stage: one LAAQ setting y for every layer under
LAAQ's functions; alike layers: each (kind, option) keeps the same bytes in every layer, errors differ by layer;
step seconds a count, agoq.search.milp_levels), with offload offered (ChoiceProblem.offload): layers 0..K-1 keep
their saved tensors in host memory, none of them checkpointed. A choice is then the counts n_u (unmodified), n_c
(checkpointed), n_a = L - n_u - n_c (under LAAQ), the offloaded prefix's length K and its unmodified layers K_u
(K_a = K - K_u under LAAQ), the setting y, and where the layers of each state sit. With U, B(y), C the bytes of an
unmodified layer, of a layer under LAAQ at y and of a checkpointed one, T the LAAQ transient (when n_a > 0):

  host bytes  G = K_u U + K_a B(y) <= host budget
  step        = level(n_u, n_c) + accum x max(0, G x link - window) + G x seconds_per_byte + K x layer_seconds
  end of forward:  E = static + (n_u - K_u) U + (n_a - K_a) B(y) + n_c C + T + max(0, G - forward_link_bytes)
                   <= budget
  start of backward:  E + h + e_top + D <= budget,   h = the largest offloaded layer's bytes (U where K_u > 0, B(y)
                   where K_a > 0), e_top the top layer's end_of_backward bytes (backward's first prefetch), D an
                   offloaded layer's backward on top (agoq.search.problem.OffloadPrices.backward_bytes)
  offloaded layers' backward:  static + e_0 + h + D <= budget, and where K >= 2
                   static + e_1 + (the two largest of K_u U and K_a B(y)) + D <= budget
  floor:           K > 0 needs the measured offloading peak (OffloadPrices.floor_bytes) <= budget
  changed tensors  = n_a x (kinds of y not at 16) + n_c + K

The offloaded prefix keeps nothing on the GPU in backward, and the i-th checkpointed layer (i = 0..n_c-1, from the
bottom, at height K + i + a_i with a_i layers under LAAQ between the prefix and it, checkpointed layers at the lowest
places the layers under LAAQ leave free above the prefix: agoq.search.milp_uniform) holds in its backward

  static + a_i B(y) + (i + 1) C + r(0) - (K + i + a_i) g + T + h  <=  budget

(r(h) = r(0) - h g its rerun bytes, agoq.search.milp_uniform), so a_i <= cap_i(y) with the prefix's K layers of
height added to the room: the nested capacities of agoq.search.milp_uniform over the layers above the prefix. Which
of the prefix's layers run under LAAQ changes neither bytes nor time: the K_a of least error e_l(y). The least error
of a configuration (n_u, n_c, K, K_u, y) is therefore the K_a least errors within the prefix plus the nested-capacity
greedy above it, both exact.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from agoq.runtime.activations.policy import KINDS
from agoq.search.memory_phases import PHASES, phase_sum
from agoq.search.milp_uniform import _alike, _nested_caps, _nested_least, setting_errors, settings

BLOCK = 1 << 13  # settings whose per-layer errors are computed together


class Configurations:
    """The per-model constants of the enumeration and the amounts of each configuration; `_build` returns None
    where the structure does not hold."""

    @classmethod
    def _build(cls, m) -> Optional["Configurations"]:
        p = m.p
        if not getattr(m, "offload", False) or m.levels is None or not p.one_setting_per_stage:
            return None
        alike = _alike(m)
        if alike is None:
            return None
        L = m.L
        kinds, options = alike["kinds"], alike["options"]
        if any("16" not in options[k] for k in kinds):
            return None
        if np.asarray(p.in_flight_counts(), float).max() != 1:
            return None
        reruns = p.recomputed()
        g = float(reruns[0] - reruns[1]) if L > 1 else 0.0
        if p.allow_checkpoint and (g < 0 or np.ptp(p.checkpoint_seconds) > 0
                                   or np.abs(reruns - (reruns[0] - g * np.arange(L))).max()
                                   > 1e-6 * max(1.0, abs(reruns[0]))):
            return None
        self = cls()
        self.m, self.p, self.L, self.g = m, p, L, g
        self.kinds, self.options, self.alike = kinds, options, alike
        mem = m.memory_rows[0]
        self.sixteen = {k: options[k].index("16") for k in kinds}
        att, oproj = KINDS.index("attention"), KINDS.index("o_proj_input")
        self.att, self.oproj = att, oproj
        self.credit_on = att in kinds and oproj in kinds and m.bounds.ub[m.w0] > 0
        credit = float(mem[m.w0])
        self.credit = credit
        self.U = float(sum(alike["bytes"][k][self.sixteen[k]] for k in kinds)) + float(mem[m.u0]) \
            + (credit if self.credit_on else 0.0)
        self.C = float(mem[m.c0])
        self.r0 = float(reruns[0])
        self.T = float(mem[m.z0])
        eob = p.end_of_backward_bytes()
        self.e_top = float(eob[p.top_layers()[0]])  # at the start of backward, with h
        self.e0, self.e1 = float(eob[0]), float(eob[1]) if L > 1 else 0.0  # in the backward of layers 0 and 1
        choice, per_layer, non16 = settings(m, alike)  # every kind's options that are not dominated
        keep = non16 > 0  # a layer under LAAQ changes some kind
        choice, per_layer, non16 = choice[keep], per_layer[keep], non16[keep]
        if len(choice) == 0 or self.U <= 0 or per_layer.min() <= 0:
            return None  # an offloaded layer of no bytes: left to the MILP
        if p.allow_checkpoint and (self.C > self.U or (g > 0 and self.U < g) or per_layer.min() <= g):
            return None  # the placement of checkpointed layers assumes these (agoq.search.milp_uniform)
        order = np.argsort(per_layer, kind="stable")  # ascending bytes: within a configuration, fastest first
        self.choice, self.B, self.non16 = choice[order], per_layer[order], non16[order]
        self.distinct, self.rank = np.unique(self.B, return_inverse=True)  # ascending distinct bytes, each one's
        self.ends = np.searchsorted(self.B, self.distinct, side="right")   # rank; where each one's settings end
        # each setting's per-layer errors, computed a block of settings at a time as they are first needed
        self.E = np.zeros((L, len(self.B))) if L * len(self.B) <= 1 << 22 else None
        self._have = np.zeros((len(self.B) + BLOCK - 1) // BLOCK, dtype=bool)
        self._bounds: dict = {}
        self._configs = None
        o = p.offload
        self.o = o
        self.ckpt_seconds = float(p.checkpoint_seconds[0]) if p.allow_checkpoint and L else 0.0
        self.tolerance = 1e-7 * m.unit  # HiGHS's feasibility tolerance on the model's rows (agoq.search.milp_uniform)
        return self

    # -- pieces -------------------------------------------------------------------------------------------------

    def link(self, G: np.ndarray, K: int) -> np.ndarray:
        """The step seconds G bytes offloaded by K layers add (ChoiceProblem.offload_seconds), vectorised."""
        o = self.o
        G = np.asarray(G, float)
        s = o.grad_accum * np.maximum(0.0, G * o.link_seconds_per_byte - o.window_seconds) \
            + G * o.seconds_per_byte + np.asarray(K, float) * o.layer_seconds
        return np.where(G > 0, s, 0.0)

    def configurations(self):
        """(n_u, n_c, K, K_u, level row seconds): every configuration with an offloaded layer (K > 0)."""
        p, L = self.p, self.L
        laaq = p.laaq_layer_seconds
        for n_c in (range(L + 1) if p.allow_checkpoint else range(1)):
            for n_u in range(L - n_c + 1):
                n_a = L - n_u - n_c
                row = -laaq * n_u + (self.ckpt_seconds - laaq) * n_c
                for K in range(1, L - n_c + 1):
                    for K_u in range(max(0, K - n_a), min(K, n_u) + 1):
                        yield n_u, n_c, K, K_u, row

    def bounded(self) -> list:
        """(the least step row seconds, n_u, n_c, K, K_u, level row seconds) of every configuration with an
        offloaded layer, best bound first: its level plus the link's price of its least bytes (K_u U + K_a min B)."""
        if self._configs is None:
            configs = list(self.configurations())
            if not configs:
                self._configs = []
                return self._configs
            n_u, n_c, K, K_u, row = (np.array(c, float) for c in zip(*configs))
            K_a = K - K_u
            least = row + self.link(K_u * self.U + K_a * self.B[0], K) if len(configs) else np.zeros(0)
            order = np.lexsort((K_u, K, n_c, n_u, least))
            self._position = {c[:4]: i for i, c in enumerate(configs)}  # (set first: `_configs` says all three are)
            self._columns = (n_u[order], n_c[order], K[order], K_u[order])  # `bounded`'s order, as arrays
            self._configs = [(float(least[i]), int(n_u[i]), int(n_c[i]), int(K[i]), int(K_u[i]), float(row[i]))
                             for i in order]
        return self._configs

    def _rows(self, n_u, n_c, K, K_u, B):
        """The module docstring's amounts for counts and bytes B (scalars or arrays, broadcast): the host bytes G,
        the prefetched layer h, the LAAQ transient T, the end of forward E and the largest of backward's rows (-inf
        where nothing is offloaded): the memory phases' values (agoq.search.memory_phases.PHASES) at these counts,
        but a checkpointed layer's (the nested capacities: `_room`)."""
        n_a, K_a = self.L - n_u - n_c, K - K_u
        G = K_u * self.U + K_a * B
        h = np.maximum(np.where(K_u > 0, self.U, 0.0), np.where(K_a > 0, B, 0.0))
        T = np.where(n_a > 0, self.T, 0.0)
        static = float(self.p.static_bytes[0])
        # the two largest offloaded layers' bytes (where K >= 2): of K_u layers of U and K_a of B
        high, low = np.maximum(self.U, B), np.minimum(self.U, B)
        n_high = np.minimum(np.where(self.U >= B, K_u, K_a), 2)
        top2 = high * n_high + low * (2 - n_high)
        stage = {"activations": ((n_u - K_u) * self.U, (n_a - K_a) * B, n_c * self.C), "calibration": (),
                 "laaq_transient": T, "offload_backlog": np.maximum(0.0, G - self.o.forward_link_bytes),
                 "prefetch": h, "top_end_of_backward": self.e_top, "offload_backward": self.o.backward_bytes,
                 "nothing": 0.0}
        at = {0: {"end_of_backward": self.e0, "fetched": h}, 1: {"end_of_backward": self.e1, "fetched": top2}}
        end = phase_sum(PHASES[0], static, stage.get)
        back = np.full(np.broadcast(end, K).shape, -np.inf)
        for phase in PHASES:
            if not phase.offloading:
                continue
            mine = at.get(phase.layer, {})
            value = phase_sum(phase, static, lambda q: mine[q] if q in mine else stage[q])
            back = np.where(K > (phase.layer or 0), np.maximum(back, value), back)  # layer l offloaded: K > l
        return G, h, T, end, back

    def _possible(self, budget: float) -> np.ndarray:
        """Per configuration of `bounded`, False where it cannot fit whatever its setting: its rows at the least
        bytes a setting keeps (they only rise with B), every checkpointed layer with no layer under LAAQ below it.
        A necessary condition, with a little slack: the exact rows decide the rest."""
        if not self.bounded():
            return np.zeros(0, dtype=bool)
        n_u, n_c, K, K_u = self._columns
        G, h, T, end, start = self._rows(n_u, n_c, K, K_u, np.where(self.L - n_u - n_c > 0, self.B[0], 0.0))
        slack = self.tolerance + 1e-9 * abs(budget) + 1.0
        ok = (end <= budget + slack) & (start <= budget + slack) & (G <= self.o.host_budget_bytes * (1 + 1e-9) + 1.0)
        if self.o.floor_bytes > budget + slack:
            ok &= False
        room = budget - float(self.p.static_bytes[0]) - self.r0 - T - h + K * self.g
        ckpt = room - self.C + np.minimum(0.0, (n_c - 1) * (self.g - self.C))  # the least room of the n_c phases
        return ok & ((n_c == 0) | (ckpt >= -slack))

    def _fits(self, budget: float, n_u: int, n_c: int, K: int, K_u: int, B: np.ndarray) -> np.ndarray:
        """Per setting (bytes B): the end of forward, the host budget and the floor; and cap_i >= 0 for every
        checkpointed layer (a_i = 0) — what the memory allows before the layers under LAAQ are placed."""
        G, _, _, end, start = self._rows(n_u, n_c, K, K_u, B)
        ok = (end <= budget + self.tolerance) & (start <= budget + self.tolerance) \
            & (G <= self.o.host_budget_bytes * (1 + 1e-9) + 1e-6)
        if K > 0 and self.o.floor_bytes > 0 and self.o.floor_bytes > budget + self.tolerance:
            ok &= False
        return ok

    def _room(self, budget: float, n_a: int, K: int, K_u: int, B: np.ndarray) -> np.ndarray:
        """The nested capacities' room (agoq.search.milp_uniform._nested_caps) with the prefix's K layers of height
        and backward's first prefetch h."""
        _, h, T, _, _ = self._rows(self.L - n_a, 0, K, K_u, B)  # (n_u + n_c: only n_a = L - n_u - n_c counts)
        return budget - float(self.p.static_bytes[0]) - self.r0 - T - h + K * self.g + self.tolerance

    def errors(self, ys: np.ndarray) -> np.ndarray:
        """[L, settings]: each layer's error at each setting."""
        if self.E is None:
            return self._errors(ys)
        for b in np.unique(np.asarray(ys) // BLOCK):
            if not self._have[b]:
                block = np.arange(b * BLOCK, min((b + 1) * BLOCK, len(self.B)))
                self.E[:, block] = self._errors(block)
                self._have[b] = True
        return self.E[:, ys]

    def _errors(self, ys: np.ndarray) -> np.ndarray:
        return setting_errors(self.alike, self.choice, ys, self.L)

    def least_error(self, budget: float, n_u: int, n_c: int, K: int, K_u: int, ys: np.ndarray,
                    layers: bool = False):
        """Per setting in `ys`: the least error of the configuration (inf where the checkpointed layers cannot be
        placed), and with `layers` (one setting) the layers under LAAQ of that optimum."""
        L, n_a, K_a = self.L, self.L - n_u - n_c, K - K_u
        e = self.errors(ys)
        if K_a > 0:
            pre = np.sort(e[:K], axis=0)[:K_a]
            total = pre.sum(axis=0)
        else:
            total = np.zeros(len(ys))
        rest, above = e[K:], n_a - K_a
        if n_c > 0:
            caps = _nested_caps(self.B[ys], self._room(budget, n_a, K, K_u, self.B[ys]), n_c, self.C, self.g, L - K)
            more, picked = _nested_least(rest, caps, above)
        else:
            more = np.partition(rest, above - 1, axis=0)[:above].sum(axis=0) if 0 < above < L - K else \
                (rest.sum(axis=0) if above == L - K else np.zeros(len(ys)))
            picked = np.argsort(rest[:, 0], kind="stable")[:above] if layers else None
        total = total + more
        if not layers:
            return total
        chosen = list(np.argsort(e[:K, 0], kind="stable")[:K_a]) + [K + int(i) for i in (picked if picked is not None
                                                                                           else [])]
        return total, np.array(sorted(chosen), dtype=int)

    def error_bound(self, n_u: int, n_c: int, K: int, K_u: int, ys: np.ndarray) -> np.ndarray:
        """A lower bound on each setting's least error, kind by kind: the K_a least of each kind's option within the
        prefix plus the n_a - K_a least above it (no more than the least of the layers' sums, which pairs of options
        only raise: agoq.search.milp_uniform.setting_errors)."""
        n_a, K_a = self.L - n_u - n_c, K - K_u
        key = (K, K_a, n_a)
        if key not in self._bounds:
            out = np.zeros(len(self.B))
            for j, k in enumerate(self.kinds):
                err = self.alike["errors"][k]
                pre = np.sort(err[:K], axis=0)[:K_a].sum(axis=0)
                post = np.sort(err[K:], axis=0)[:n_a - K_a].sum(axis=0)
                out += (pre + post)[self.choice[:, j]]
            self._bounds[key] = out
        return self._bounds[key][ys]

    # -- the whole choice -----------------------------------------------------------------------------------------

    def x(self, n_u: int, n_c: int, K: int, K_u: int, y: Optional[int], laaq_layers: np.ndarray) -> np.ndarray:
        """The model's variable vector of a configuration, its layers under LAAQ given."""
        m, L = self.m, self.L
        x = np.zeros(m.nv)
        laaq = np.zeros(L, dtype=bool)
        laaq[laaq_layers] = True
        ckpt = np.zeros(L, dtype=bool)
        free = [l for l in range(K, L) if not laaq[l]]
        ckpt[free[:n_c]] = True  # the lowest places above the prefix the layers under LAAQ leave free
        for l in range(L):
            if ckpt[l]:
                continue
            for j, k in enumerate(self.kinds):
                pos = self.choice[y, j] if laaq[l] else self.sixteen[k]
                x[int(self.alike["index"][(l, k)][pos])] = 1.0
        x[m.u0:m.u0 + L] = ~laaq & ~ckpt
        x[m.c0:m.c0 + L] = ckpt
        x[m.z0] = float(laaq.any())
        both16 = ~ckpt & ~laaq
        if y is not None and self.credit_on:
            both16 |= ~ckpt & laaq & bool(self.choice[y, self.kinds.index(self.att)] == self.sixteen[self.att]
                                          and self.choice[y, self.kinds.index(self.oproj)] == self.sixteen[self.oproj])
        if self.credit_on:
            x[m.w0:m.w0 + L] = both16 & (m.bounds.ub[m.w0:m.w0 + L] > 0)
        for j, k in enumerate(self.kinds):  # the stage's one setting (any, where no layer runs LAAQ)
            opt = self.options[k][self.choice[y, j]] if y is not None else "16"
            x[m.y0 + m.settings_of[(0, k, opt)]] = 1.0
        off = np.arange(L) < K
        bytes_l = np.where(laaq, self.B[y] if y is not None else 0.0, self.U)
        G = float(bytes_l[off].sum())
        gu = m.unit
        x[m.o0:m.o0 + L] = off
        x[m.g0:m.g0 + L] = np.where(off, bytes_l, 0.0) / gu
        x[m.h] = float(bytes_l[off].max()) / gu if K > 0 else 0.0
        second = float(np.sort(bytes_l[off])[-2]) if K > 1 else 0.0  # t at the second largest: 2 t + sum s = the two
        x[m.t] = second / gu                                          # largest (Model's rows)
        x[m.s0:m.s0 + L] = np.where(off, np.maximum(0.0, bytes_l - second), 0.0) / gu
        x[m.e] = max(0.0, G * self.o.link_seconds_per_byte - self.o.window_seconds) * 1e3
        x[m.k] = max(0.0, G - self.o.forward_link_bytes) / gu if np.isfinite(self.o.forward_link_bytes) else 0.0
        return x

    def checked(self, x: np.ndarray, budget: float, row_seconds: float) -> bool:
        """Whether the problem's own `evaluate` agrees: the choice fits and takes the seconds it was priced at."""
        m = self.m
        ckpt = np.round(x[m.c0:m.c0 + m.L]).astype(bool)
        off = np.round(x[m.o0:m.o0 + m.L]).astype(bool)
        f = self.p.evaluate(np.nonzero(np.round(x[:m.n]))[0], ckpt, off if off.any() else None)
        seconds = m.time_constant + row_seconds
        return max(f["peak_bytes_per_stage"]) <= budget and \
            abs(f["step_seconds"] - seconds) <= abs(seconds) * 1e-9 + 1e-12 and \
            f["host_bytes"] <= self.o.host_budget_bytes

    def _fits_kept(self, budget: float, n_u: int, n_c: int, B: np.ndarray) -> np.ndarray:
        """The end-of-forward row with nothing offloaded, per setting."""
        n_a = self.L - n_u - n_c
        T = self.T if n_a > 0 else 0.0
        end = float(self.p.static_bytes[0]) + n_u * self.U + n_a * B + n_c * self.C + T
        return end <= budget + self.tolerance

    def _kept_fits(self, budget: float, n_u: int, n_c: int) -> bool:
        return bool(self._fits_kept(budget, n_u, n_c, np.zeros(1))[0])
