"""The tie-break of a compiled plan over alike layers, by enumeration instead of a MILP.

A compiled plan of one pipeline stage keeps one LAAQ setting per stage (ChoiceProblem.one_setting_per_stage): every
layer under LAAQ's functions uses the same option y_k for each kind k. Where the layers are alike (each (kind,
option) keeps the same bytes in every layer, and so do an unmodified layer's surcharge and the shared-input credit:
a decoder of one shape), and the fastest step's level has no checkpointed layer, a choice of that level is the
setting y and the set A of its n_a layers under LAAQ (the other n_u = L - n_a run unmodified), and

    bytes  = static + n_u x B_16 + n_a x B(y) + the LAAQ transient        (the same for every A)
    error  = sum over l in A of e_l(y),   e_l(y) = sum_k error(l, k, y_k)
    changed tensors = n_a x (kinds of y not at 16)

so for each y the least error is that of the n_a layers with the least e_l(y). The second objective of
agoq.search.milp_model (its error, then the fewest changed tensors, among the choices as fast as the optimum) is
then the least over every y that fits the budget and the error cap: a product of a few options per kind
(7 kinds x 7-8 options is about 1.2 million settings), evaluated in numpy in blocks, where HiGHS took 5-7 s to close
the same program's bound on the probe. `tie_break` returns None wherever the structure does not hold, and the MILP
answers as before.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.optimize import OptimizeResult

from agoq.activations.policy import KINDS

BLOCK = 1 << 17  # settings evaluated at once (the per-layer errors of a block: 16 layers x 8 bytes x BLOCK)


def _alike(m) -> Optional[dict]:
    """The per-kind options, bytes and errors of `m`'s problem when its layers are alike (module docstring), else
    None."""
    p = m.p
    if p.num_stages != 1 or not p.one_setting_per_stage or m.L == 0:
        return None
    mem = m.memory_rows[0]
    for name in ("unmodified_extra", "shared_credit", "checkpoint_memory"):
        v = np.asarray(getattr(p, name), float)
        if np.ptp(v) > 0:
            return None
    for cal in (p.unmodified_calibration, p.checkpoint_calibration):
        if cal is not None and np.ptp(np.asarray(cal, float)) > 0:
            return None
    kinds = sorted({int(k) for k in p.kind})
    options, index = {}, {}
    for (l, k), idx in m.groups.items():
        opts = tuple(p.option[i] for i in idx)
        if k not in options:
            options[k] = opts
        elif options[k] != opts:
            return None
        index[(l, k)] = idx
    if set(l for l, _ in index) != set(range(m.L)) or any((l, k) not in index for l in range(m.L) for k in kinds):
        return None
    bytes_of = {k: mem[index[(0, k)]] for k in kinds}
    for (l, k), idx in index.items():
        if not np.array_equal(mem[idx], bytes_of[k]):
            return None
    errors = {k: np.stack([p.error[index[(l, k)]] for l in range(m.L)]) for k in kinds}  # [L, options]
    return {"kinds": kinds, "options": options, "index": index, "bytes": bytes_of, "errors": errors}


def tie_break(m, best_seconds: float, counts: list, budgets: np.ndarray, error_cap: Optional[float],
              error_weight: float, change_weight: float) -> Optional[OptimizeResult]:
    """The second objective's optimum over the choices of the one tied level in `counts` ((n_u, n_c) pairs) of the
    model `m` (agoq.search.milp_model.Model), weighed as it weighs them: error x `error_weight` + changed tensors x
    `change_weight`; None where the enumeration does not apply (then the MILP answers). The choice is checked with
    the problem's own `evaluate` (it fits the budget, at `best_seconds`) before it is returned."""
    if len(counts) != 1:
        return None
    n_u, n_c = counts[0]
    if n_u is None or n_c != 0:
        return None
    alike = _alike(m)
    if alike is None:
        return None
    p, L = m.p, m.L
    n_a = L - n_u
    if n_a == 0:
        return None  # nothing to choose: the MILP's answer is immediate
    kinds, options = alike["kinds"], alike["options"]
    if any("16" not in options[k] for k in kinds):
        return None
    mem = m.memory_rows[0]
    sixteen = {k: options[k].index("16") for k in kinds}
    # the bytes of one unmodified layer, and of one layer under LAAQ at each setting
    att, oproj = KINDS.index("attention"), KINDS.index("o_proj_input")
    credit = float(mem[m.w0])  # the shared-input credit of layer 0 (negative bytes), alike in every layer
    u_bytes = float(sum(alike["bytes"][k][sixteen[k]] for k in kinds)) + float(mem[m.u0]) \
        + (credit if att in kinds and oproj in kinds and m.bounds.ub[m.w0] > 0 else 0.0)
    room = float(np.asarray(budgets, float)[0]) - float(p.static_bytes[0]) - n_u * u_bytes \
        - (float(mem[m.z0]) if n_a > 0 else 0.0)
    grids = np.meshgrid(*[np.arange(len(options[k])) for k in kinds], indexing="ij")
    choice = np.stack([g.ravel() for g in grids], axis=1)  # [settings, kinds] option positions
    per_layer = np.zeros(len(choice))
    non16 = np.zeros(len(choice))
    for j, k in enumerate(kinds):
        per_layer += alike["bytes"][k][choice[:, j]]
        non16 += choice[:, j] != sixteen[k]
    if att in kinds and oproj in kinds and m.bounds.ub[m.w0] > 0:
        both = (choice[:, kinds.index(att)] == sixteen[att]) & (choice[:, kinds.index(oproj)] == sixteen[oproj])
        per_layer += np.where(both, credit, 0.0)
    # the model's rows are in its own unit: the same tolerance as its constraint (HiGHS's 1e-7 feasibility)
    fits = (n_a * per_layer <= room + 1e-7 * m.unit) & (non16 > 0)  # a layer under LAAQ changes some kind
    candidates = np.nonzero(fits)[0]
    if len(candidates) == 0:
        return None
    best_value, best_y, best_layers = np.inf, None, None
    for start in range(0, len(candidates), BLOCK):
        ys = candidates[start:start + BLOCK]
        e = np.zeros((L, len(ys)))
        for j, k in enumerate(kinds):
            e += alike["errors"][k][:, choice[ys, j]]
        least = np.partition(e, n_a - 1, axis=0)[:n_a] if n_a < L else e
        total = least.sum(axis=0)
        value = error_weight * total + change_weight * n_a * non16[ys]
        if error_cap is not None:
            value = np.where(total <= error_cap * (1 + 1e-9) + 1e-15, value, np.inf)
        i = int(np.argmin(value))
        if value[i] < best_value:
            best_value, best_y = float(value[i]), int(ys[i])
            best_layers = np.argsort(e[:, i], kind="stable")[:n_a]
    if best_y is None or not np.isfinite(best_value):
        return None
    x = np.zeros(m.nv)
    laaq = np.zeros(L, dtype=bool)
    laaq[best_layers] = True
    for l in range(L):
        for j, k in enumerate(kinds):
            pos = choice[best_y, j] if laaq[l] else sixteen[k]
            x[int(alike["index"][(l, k)][pos])] = 1.0
    x[m.u0:m.u0 + L] = ~laaq
    figures = p.evaluate(np.nonzero(x[:m.n])[0], np.zeros(L, dtype=bool))
    if max(figures["peak_bytes_per_stage"]) > float(np.asarray(budgets, float)[0]) or \
            abs(figures["step_seconds"] - best_seconds) > abs(best_seconds) * 1e-9 + 1e-12:
        return None  # not what the model prices it at: leave it to the MILP
    return OptimizeResult(x=x, status=0, success=True, fun=best_value, mip_gap=0.0,
                          message="optimal: the least error, then fewest changes, of every LAAQ setting of the level")


__all__ = ["tie_break"]
