"""The linear relaxation's neighbourhood: a MILP with every layer the relaxation already settles fixed as it has
it, whose answer counts only where it is certified by the relaxation's bound.

Where an offloaded prefix's relaxation is integral in all but a few layers, HiGHS still spends most of its solve of
the whole prefix in root cuts before its randomized rounding finds a choice (the H100 probe profile's tightest
budget: the eager QuanGrad problem's prefix of 11 offloaded layers, 0.4-0.6 s, its relaxation fractional in 5 of
16 layers and 0.19 % below the optimum). With the 11 settled layers fixed, the 5 others are a MILP of 0.04-0.05 s.

Exactness: the relaxation's optimum `bound` is a lower bound on every choice of the prefix, so a choice found here
with value v and v - bound <= gap |v| is within `gap` of the prefix's optimum, the very guarantee HiGHS gives at
that relative MIP gap. Where the neighbourhood has no choice, or none that close, None: the caller solves the whole
prefix, as before.

It is solved with HiGHS's presolve, which the whole prefixes are not (agoq.search.milp_model.over_prefixes: it once
called a choice optimal that was not, and can call one that meets a row exactly infeasible). Neither harms here: an
answer is kept only where the bound certifies it, and "infeasible" sends the caller to the whole prefix. With it the
neighbourhood took 0.04-0.05 s against 0.11-0.15 s on the H100 probe's tightest budget, and where it could not be
certified (the H200 probe's: its optimum is 0.36 % above the relaxation's, the whole prefix's solve proves it at
0.3 % with cuts) it cost 0.09 s against 0.30 s.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.optimize import Bounds, OptimizeResult

from agoq.search.highs import milp

__all__ = ["near_relaxation", "settled_layers"]

# the least MIP gap it is tried at: at the tie-break's (1e-7) a choice this near the relaxation is one it has
# exactly, and on the H100 probe's tightest budget the tie-break's neighbourhood never had it (0.13-0.16 s lost)
LEAST_GAP = 1e-4
FRACTIONAL = 1e-6  # a relaxed 0/1 variable this far from 0 and 1 is fractional (HiGHS's simplex answers are vertices)


def settled_layers(model, x: np.ndarray) -> np.ndarray:
    """Per layer, whether the relaxed answer `x` is integral in every one of its options, its checkpoint and its
    all-at-16 variable."""
    far = np.abs(x - np.round(x)) > FRACTIONAL
    settled = ~(far[model.c0:model.c0 + model.L] | far[model.u0:model.u0 + model.L])
    for (layer, _kind), idx in model.groups.items():
        if far[list(idx)].any():
            settled[layer] = False
    return settled


def near_relaxation(model, c: np.ndarray, constraints: list, bounds: Bounds, x: np.ndarray, bound: float,
                    gap: float, options: dict, integrality: Optional[np.ndarray] = None) -> Optional[OptimizeResult]:
    """min c x over `model`'s choices within `bounds` and `constraints`, with the layers the relaxed answer `x`
    (value `bound`) settles fixed as it has them: its answer, `certified` where its value v has v - bound <= gap |v|
    (then status 0, `mip_gap` that relative distance; else status 1, a choice of the prefix to start its whole
    solve from). None where it has no choice, where every layer is fractional (nothing to fix) or `gap` is below
    LEAST_GAP. `integrality`: as over_prefixes'."""
    if gap < LEAST_GAP:
        return None
    settled = settled_layers(model, x)
    if not settled.any():
        return None
    lb, ub = bounds.lb.copy(), bounds.ub.copy()
    for (layer, _kind), idx in model.groups.items():
        if settled[layer]:
            lb[list(idx)] = ub[list(idx)] = np.round(x[list(idx)])
    checkpoints = model.c0 + np.flatnonzero(settled)
    lb[checkpoints] = ub[checkpoints] = np.round(x[checkpoints])
    res = milp(c, constraints=constraints, integrality=model.integrality if integrality is None else integrality,
               bounds=Bounds(lb, ub),
               options={**options, "mip_rel_gap": gap, "presolve": True})  # see the module docstring
    if res.x is None:
        return None
    value = float(c @ model.rounded(res.x))
    distance = value - bound
    res.certified = distance <= gap * abs(value)
    res.status, res.success = (0, True) if res.certified else (1, False)
    res.mip_gap = float(max(distance, 0.0) / max(abs(value), 1e-30))
    return res
