"""The fastest choice and its tie-break where a prefix of alike layers may be offloaded: by enumeration, not a MILP.

The structure, its configurations (n_u, n_c, K, K_u, y) and their amounts (memory rows, least error) are those of
agoq.search.milp_offload_configs.

The fastest step is the least, over the configurations, of the step of those that fit the budget and the error
cap. Every configuration's step is bounded below by its counts' level plus the link's price of its least bytes
(K_u U + K_a min_y B(y)), and the fastest choice keeping every layer (agoq.search.milp_levels, K = 0) is an answer
to beat: configurations are visited best bound first until the bound reaches the best found. Within one, the step
rises with B(y) and the memory rows only loosen as B(y) falls, so the settings are taken by ascending B(y); the
first whose least error meets the cap (a kind-by-kind bound first, as in agoq.search.milp_uniform) is its fastest.
A configuration whose rows fail at the least bytes any setting keeps (every checkpointed layer with no layer under
LAAQ below it) cannot fit at all: those are ruled out together, before the visit. The settings are those of
agoq.search.milp_uniform.settings (none with a dominated option).
The tie-break (the least error, then fewest changed tensors, among the choices as fast as the optimum, within the
tolerance of agoq.search.milp_model's second solve) takes every configuration whose bound is within that tolerance,
and in it every setting whose step is: the least value over them. Both return None wherever the structure does not
hold (then the MILP answers), and check their choice with the problem's own `evaluate` first.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.optimize import OptimizeResult

from agoq.search.milp_offload_configs import Configurations

CHUNK = 1 << 12  # settings given their exact least error at once


class Enumeration(Configurations):
    """The fastest choice and its tie-break by enumeration; `build` returns None where the structure does not hold."""

    @classmethod
    def build(cls, m) -> Optional["Enumeration"]:
        """The enumeration of `m`'s problem, built once per problem (ChoiceProblem.derived): every model of a problem
        has the same rows, and what it fills in as it goes (each setting's errors, the configurations in bound
        order) is the problem's too."""
        return m.p.derived("offload_enumeration", lambda: cls._build(m))


    def _settings_of(self, n_u: int, n_c: int, K: int, K_u: int, budget: float, row: float, limit: float,
                     strict: bool):
        """Settings of the configuration that fit its memory rows, with their step row seconds, those below `limit`
        (or at most `limit` when not `strict`) in ascending bytes."""
        K_a = K - K_u
        # the rows and the step only rise with B(y), and the settings are in ascending B: a prefix of them, found on
        # the distinct byte counts
        ok = self._fits(budget, n_u, n_c, K, K_u, self.distinct)
        t = row + self.link(K_u * self.U + K_a * self.distinct, K)
        ok &= t < limit if strict else t <= limit
        count = int(np.argmin(ok)) if not ok.all() else len(ok)
        end = int(self.ends[count - 1]) if count else 0
        ys = np.arange(end)
        return ys, t[self.rank[:end]]

    def fastest(self, budgets: np.ndarray, error_cap: Optional[float], kept) -> Optional[OptimizeResult]:
        """The exact fastest choice, offload included, given `kept` (agoq.search.milp_levels' fastest choice keeping
        every layer: an OptimizeResult with .seconds, or x None where nothing kept fits); None where a choice the
        enumeration finds does not check out (the MILP then answers)."""
        m = self.m
        budget = float(np.asarray(budgets, float)[0])
        best_row = float(kept.seconds) - m.time_constant if kept.x is not None else np.inf
        best = None  # (row seconds, configuration, setting)
        possible = self._possible(budget)
        for at, (least, n_u, n_c, K, K_u, row) in enumerate(self.bounded()):
            if not least < best_row:
                break
            if not possible[at]:
                continue
            n_a = self.L - n_u - n_c
            if n_a == 0:  # no setting: one choice (unmodified, checkpointed, the prefix), no error
                if self._fits(budget, n_u, n_c, K, K_u, np.zeros(1))[0] and self._no_laaq_fits(budget, n_c, K, K_u):
                    best_row, best = least, (least, (n_u, n_c, K, K_u), None)
                continue
            found = self._settings_of(n_u, n_c, K, K_u, budget, row, best_row, strict=True)
            ys, ts = found
            for start in range(0, len(ys), CHUNK):
                chunk, tchunk = ys[start:start + CHUNK], ts[start:start + CHUNK]
                if not tchunk[0] < best_row:
                    break
                if error_cap is not None:
                    fine = self.error_bound(n_u, n_c, K, K_u, chunk) <= error_cap * (1 + 1e-9) + 1e-15
                    chunk, tchunk = chunk[fine], tchunk[fine]
                    if len(chunk) == 0:
                        continue
                err = self.least_error(budget, n_u, n_c, K, K_u, chunk)
                fine = np.isfinite(err) if error_cap is None else err <= error_cap * (1 + 1e-9) + 1e-15
                if fine.any():
                    i = int(np.argmax(fine))  # ascending bytes: the first that meets the cap is the fastest
                    if tchunk[i] < best_row:
                        best_row, best = float(tchunk[i]), (float(tchunk[i]), (n_u, n_c, K, K_u), int(chunk[i]))
                    break
        if best is None:
            return kept  # no configuration that offloads is faster than the best kept one (or nothing fits at all)
        row, x = best[0], self._choice(budget, best)
        if x is None:
            return None
        return OptimizeResult(x=x, status=0, success=True, fun=row, mip_gap=0.0, seconds=m.time_constant + row,
                              message="optimal: the fastest of every configuration (offloaded prefix, counts, "
                                      "setting) enumerated")

    def _choice(self, budget: float, best: tuple) -> Optional[np.ndarray]:
        """The model's variables of `best` ((row seconds, (n_u, n_c, K, K_u), setting or None)), with the layers of
        least error under LAAQ; None where the problem's own `evaluate` does not agree."""
        row, (n_u, n_c, K, K_u), y = best
        if y is None:
            layers = np.zeros(0, dtype=int)
        else:
            _, layers = self.least_error(budget, n_u, n_c, K, K_u, np.array([y]), layers=True)
        x = self.x(n_u, n_c, K, K_u, y, layers)
        return x if self.checked(x, budget, row) else None

    def _no_laaq_fits(self, budget: float, n_c: int, K: int, K_u: int) -> bool:
        """With no layer under LAAQ: whether every checkpointed layer's backward fits (a_i = 0)."""
        room = float(np.atleast_1d(self._room(budget, 0, K, K_u, np.zeros(1)))[0])
        i = np.arange(n_c)
        return bool(np.all(room - (i + 1) * self.C + i * self.g >= 0))

    def tie_break(self, best_row: float, budgets: np.ndarray, error_cap: Optional[float], error_weight: float,
                  change_weight: float) -> Optional[OptimizeResult]:
        """agoq.search.milp_model's second objective (error x `error_weight` + changed tensors x `change_weight`)
        over every choice whose step row seconds are within the tie tolerance of `best_row`, offload included;
        None where the choice found does not check out."""
        budget = float(np.asarray(budgets, float)[0])
        limit = best_row + abs(best_row) * 1e-9 + 1e-12
        best_value, best = np.inf, None
        levels = []
        for n_c in (range(self.L + 1) if self.p.allow_checkpoint else range(1)):
            for n_u in range(self.L - n_c + 1):
                row = -self.p.laaq_layer_seconds * n_u + (self.ckpt_seconds - self.p.laaq_layer_seconds) * n_c
                levels.append((n_u, n_c, row))
        # the choices keeping every layer, then those offloading, each in the order of `configurations`
        configs = [(row, n_u, n_c, 0, 0, row) for n_u, n_c, row in levels] + \
            sorted(self.bounded(), key=lambda c: self._position[c[1:5]])
        for least, n_u, n_c, K, K_u, row in configs:
            n_a = self.L - n_u - n_c
            if least > limit:
                continue
            if n_a == 0:
                if K > 0 and not self._fits(budget, n_u, n_c, K, K_u, np.zeros(1))[0]:
                    continue
                if K == 0 and not self._kept_fits(budget, n_u, n_c):
                    continue
                if not self._no_laaq_fits(budget, n_c, K, K_u):
                    continue
                value = change_weight * (n_c + K)
                if value < best_value:
                    best_value, best = value, (row + float(self.link(K_u * self.U, K)), (n_u, n_c, K, K_u), None)
                continue
            if K == 0:
                ok = self._fits_kept(budget, n_u, n_c, self.distinct)  # rises with B(y): a prefix
                count = int(np.argmin(ok)) if not ok.all() else len(ok)
                ys = np.arange(int(self.ends[count - 1]) if count else 0)
                ts = np.full(len(ys), row)
            else:
                ys, ts = self._settings_of(n_u, n_c, K, K_u, budget, row, limit, strict=False)
            if len(ys) == 0:
                continue
            changes = n_a * self.non16[ys] + n_c + K
            bound = error_weight * self.error_bound(n_u, n_c, K, K_u, ys) + change_weight * changes
            order = np.argsort(bound, kind="stable")
            for start in range(0, len(order), CHUNK):
                part = order[start:start + CHUNK]
                if not bound[part[0]] < best_value:
                    break
                part = part[bound[part] < best_value]
                err = self.least_error(budget, n_u, n_c, K, K_u, ys[part])
                value = error_weight * err + change_weight * changes[part]
                if error_cap is not None:
                    value = np.where(err <= error_cap * (1 + 1e-9) + 1e-15, value, np.inf)
                i = int(np.argmin(value))
                if value[i] < best_value:
                    best_value, best = float(value[i]), (float(ts[part[i]]), (n_u, n_c, K, K_u), int(ys[part[i]]))
        x = None if best is None else self._choice(budget, best)
        if x is None:
            return None
        return OptimizeResult(x=x, status=0, success=True, fun=best_value, mip_gap=0.0,
                              message="optimal: the least error, then fewest changes, of every configuration "
                                      "(offloaded prefix, counts, setting) as fast as the optimum")


__all__ = ["Enumeration"]
