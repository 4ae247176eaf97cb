"""The least peak memory a problem's choices reach within caps on step time and gradient error: the smallest budget
that fits (agoq.search.milp.Solver.smallest_budget), over the matrices of agoq.search.milp_model.Model.

    minimise t  subject to  (memory row of each stage and backward peak) x + static <= t unit,
                            (offload's floor rows) x + static <= t unit,  t >= the optimizer step's floor / unit,
                            the choice's structure rows, and the caps

t in the model's memory unit (bytes / unit), continuous; the rest are the model's variables. The floor is a bound on
t, not a row: a choice below it is as good as any (Allocation's peaks include the floor), which HiGHS then finds at
once (the H200 probe profile's fp32-AdamW problems under the recipe's error cap: 0.05-0.3 s against 7-10 s). Where
layers may be offloaded it is solved one offloaded prefix at a time (Model.over_prefixes: the QuanGrad problems of
that profile 0.05-2.3 s against 1.7-7 s for the whole MILP).

`below` asks only for a choice under a budget another problem already fits (agoq.search.knobs.least_budget: the least
over knob combinations): prefixes whose relaxation is no lower are not solved, and HiGHS's `objective_bound` ends the
others' search as soon as their bound passes it (0.03 s where the whole solve took 1.6 s).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint
from scipy.sparse import csr_matrix, hstack

from agoq.search.highs import milp
from agoq.search.milp_model import GAP, primary_gap

__all__ = ["least_peak", "least_peak_bound"]


def _problem(model, time_cap: Optional[float], error_cap: Optional[float]):
    """(c, constraints, bounds, integrality) of the least-peak MILP (see the module docstring); t is the last
    column."""
    nv = model.nv + 1
    mem = np.hstack([model.peak_rows / model.unit, -np.ones((len(model.peak_stage), 1))])
    structure = LinearConstraint(hstack([csr_matrix(model.structure.A), csr_matrix((model.structure.A.shape[0], 1))]),
                                 model.structure.lb, model.structure.ub)
    cons = [structure, LinearConstraint(mem, -np.inf,
                                        -(model.p.static_bytes[model.peak_stage] + model.peak_offset) / model.unit)]
    if len(model.floor_rows):  # offloading any layer: t >= the floor (constraints)
        row = np.hstack([model.floor_rows / model.unit, -np.ones((len(model.floor_rows), 1))])
        cons.append(LinearConstraint(row, -np.inf, -float(model.p.static_bytes[0]) / model.unit))
    if time_cap is not None:
        cons.append(LinearConstraint(np.append(model.time_row, 0.0)[None, :] * 1e3, -np.inf,
                                     (time_cap - model.time_constant) * 1e3))
    if error_cap is not None:
        scale = max(float(np.abs(model.error_row).max()), 1e-30)
        cons.append(LinearConstraint(np.append(model.error_row, 0.0)[None, :] / scale, -np.inf, error_cap / scale))
    c = np.zeros(nv)
    c[-1] = 1.0
    lb = np.append(model.bounds.lb, float(np.max(model.p.peak_floor())) / model.unit)
    ub = np.append(model.bounds.ub, np.inf)
    return c, cons, Bounds(lb, ub), np.append(model.integrality, 0)


def least_peak(model, time_cap: Optional[float], error_cap: Optional[float], time_limit: Optional[float],
               below: Optional[float] = None, patient: bool = True):
    """The choice of least peak (the largest stage's) within the caps, an Allocation; None when the caps cannot be
    met, or, with `below` (bytes), when no choice has a peak under it. `time_limit` bounds HiGHS's search (its best
    choice found by then is kept; none found: it searches on, unless not `patient`: then None)."""
    c, cons, bounds, integrality = _problem(model, time_cap, error_cap)
    cutoff = np.inf if below is None else float(below) / model.unit
    if cutoff <= bounds.lb[-1]:
        return None  # the optimizer step alone reaches `below`
    options = {"mip_rel_gap": GAP, **({"time_limit": time_limit} if time_limit else {}),
               **({"objective_bound": cutoff} if np.isfinite(cutoff) else {})}
    res = None
    if model.offload:
        res = model.over_prefixes(c, cons, bounds, options, time_limit, integrality=integrality, cutoff=cutoff)
    if res is None:  # no offload, or the time limit came before a prefix's choice: the whole MILP
        if model.offload and not patient:
            return None
        res = milp(c, constraints=cons, integrality=integrality, bounds=bounds, options=options)
    if res.x is None and res.status == 1 and patient:  # the time limit came before any choice: search on
        res = milp(c, constraints=cons, integrality=integrality, bounds=bounds,
                   options={k: v for k, v in options.items() if k != "time_limit"})
    if res.x is None:
        return None
    alloc = model.allocation(res.x[:-1], gap=primary_gap(res))
    return alloc if below is None or max(alloc.peak_bytes_per_stage) < below else None


def least_peak_bound(model, time_cap: Optional[float], error_cap: Optional[float],
                     by_prefix: bool = False) -> Optional[float]:
    """A lower bound on least_peak's peak, bytes: its linear relaxation's optimum (every 0/1 variable in [0, 1]), one
    LP; `by_prefix`, where layers may be offloaded, the least of the offloaded prefixes' relaxations (Model.
    relaxed_prefixes: L + 1 LPs, each from the last one's basis), a tighter bound (the H200 probe profile's bf16
    problems at 2 x 1: 9.83 GB against 9.68). None where not even the relaxation meets the caps (then no choice
    does); -inf where HiGHS gives no answer."""
    c, cons, bounds, _ = _problem(model, time_cap, error_cap)
    if by_prefix and model.offload:
        ranked = model.relaxed_prefixes(c, cons, bounds)
        if ranked is None:
            return -np.inf
        return min(value for value, *_ in ranked) * model.unit if ranked else None
    res = milp(c, constraints=cons, integrality=np.zeros(len(c)), bounds=bounds)
    if res.status == 2:
        return None
    return -np.inf if res.x is None else float(res.x[-1]) * model.unit
