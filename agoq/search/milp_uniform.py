"""The tie-break of a compiled plan over alike layers, by enumeration instead of a MILP.

A compiled plan of one pipeline stage keeps one LAAQ setting per stage (ChoiceProblem.one_setting_per_stage): every
layer under LAAQ's functions uses the same option y_k for each kind k. Where the layers are alike (each (kind,
option) keeps the same bytes in every layer, and so do an unmodified layer's surcharge and the shared-input credit:
a decoder of one shape), a choice of the fastest step's level without checkpointed layers is the setting y and the
set A of its n_a layers under LAAQ (the other n_u = L - n_a run unmodified), and

    bytes  = static + n_u x B_16 + n_a x B(y) + the LAAQ transient        (the same for every A)
    error  = sum over l in A of e_l(y),   e_l(y) = sum_k error(l, k, y_k) + sum_{K recomputed in y} pair(l, K, y_S)
                                          (pair: the error K's source S at y_S brings it, ChoiceProblem.pair_options)
    changed tensors = n_a x (kinds of y not at 16)

so for each y the least error is that of the n_a layers with the least e_l(y).

Where the level checkpoints n_c > 0 layers (no error, no options: a checkpointed layer keeps only its input, C
bytes), the bytes at the end of forward add n_c x C whatever their places, but each checkpointed layer's backward
holds what the layers below it keep, its own input and its rerun forward (agoq.search.problem). Given A, placing
the checkpointed layers at the lowest places A leaves free keeps every such phase lowest (when C is no more than an
unmodified layer's bytes: a swap never helps), and its highest checkpointed layer sets its peak: it fits when at
most K(y) layers under LAAQ sit below it, that is at most K(y) of A among the lowest n_c + K(y) layers. The least
error under that cap is the least errors taken greedily from the two groups (exact: a capacity on one group is a
partition matroid). The second objective of
agoq.search.milp_model (its error, then the fewest changed tensors, among the choices as fast as the optimum) is
then the least over every y that fits the budget and the error cap: a product of a few options per kind
(7 kinds x 7-8 options is about 1.2 million settings), where HiGHS took 5-7 s to close the same program's bound on
the probe. Each setting is first bounded kind by kind (the n_a least errors of each kind's option, summed: no more
than the least n_a of the layers' sums), and its exact least error is computed, in numpy, only for settings whose
bound could still win, best bound first. `tie_break` returns None wherever the structure does not hold, and the MILP
answers as before. A setting with a dominated option (one not at 16 keeping no fewer bytes and no less error in any
layer than another option not at 16 of its kind, strictly more somewhere or listed after it) is never enumerated: the
setting with that other option keeps no more bytes, no more error in any layer and as many changed tensors, so it
fits wherever the first does, and its least error is no larger.

Where the backward of a checkpointed layer also holds the gradients made by then (bf16 gradients, one micro-batch
per step: agoq.search.costs._end_of_backward), layer h's rerun bytes fall by g per layer of height, r(h) = r(0) -
h g. The i-th checkpointed layer (from the bottom, i = 0..n_c-1) with a_i layers under LAAQ below it then fits when

    a_i (B(y) - g) + (i + 1) C - i g + r(0) <= budget - static - transient

so a_i <= cap_i(y) for every i: at most cap_i of A among the lowest i + cap_i + 1 layers. Those prefixes are nested
(a laminar matroid), where greedy by error is still exact. The lowest places stay the best for the checkpointed
layers when a layer's bytes below a checkpointed layer never fall short of what its height saves: B(y) >= g (a
setting below it is left to the MILP) and an unmodified layer's bytes >= g.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.optimize import OptimizeResult

from agoq.runtime.activations.policy import KINDS

CHUNK = 1 << 12  # settings given their exact least error at once, best bound first


def _alike(m) -> Optional[dict]:
    """The per-kind options, bytes and errors of `m`'s problem when its layers are alike (module docstring), else
    None (found once per model)."""
    if not hasattr(m, "_alike"):
        m._alike = _find_alike(m)
    return m._alike


def _find_alike(m) -> Optional[dict]:
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
    return {"kinds": kinds, "options": options, "index": index, "bytes": bytes_of, "errors": errors,
            "pairs": _alike_pairs(p, kinds, options, index, m.L)}


def _alike_pairs(p, kinds: list, options: dict, index: dict, L: int) -> dict:
    """The pairs of options (ChoiceProblem.pair_options) by kind: recomputed kind K -> (its source kind S, the
    position of K's recompute option, [L, options of S] the error each of S's options adds in each layer where K is
    recomputed: 0 for those in no pair)."""
    position = {}
    for (_l, k), idx in index.items():
        position.update({int(i): o for o, i in enumerate(idx)})
    out: dict = {}
    pairs, error = p.pairs()
    for (r, b), e in zip(pairs, error):
        K, S = int(p.kind[r]), int(p.kind[b])
        entry = out.setdefault(K, (S, position[int(r)], np.zeros((L, len(options[S])))))
        entry[2][int(p.layer[b]), position[int(b)]] = e
    return out


def setting_errors(alike: dict, choice: np.ndarray, ys: np.ndarray, L: int) -> np.ndarray:
    """[L, settings]: each layer's error under LAAQ at each setting `ys` (rows of `choice`, option positions per kind):
    its kinds' errors, and for each kind recomputed in the setting the error its source's option there brings it
    (ChoiceProblem.pair_options)."""
    kinds = alike["kinds"]
    e = np.zeros((L, len(ys)))
    for j, k in enumerate(kinds):
        e += alike["errors"][k][:, choice[ys, j]]
    for K, (S, recompute, added) in alike["pairs"].items():
        on = choice[ys, kinds.index(K)] == recompute
        e += np.where(on[None, :], added[:, choice[ys, kinds.index(S)]], 0.0)
    return e


def dominated(alike: dict, k: int, o: int, sixteen: int) -> bool:
    """Whether option `o` of kind `k` (not at 16) keeps no fewer bytes and no less error in any layer than another
    option not at 16, and strictly more somewhere or is listed after it: in any setting, swapping it for that one
    keeps no more bytes, no more error in any layer and as many changed tensors, so it is never needed. With pairs
    (agoq.search.milp_rows.dominated_options): a recompute option beats another only with its largest pair's error
    added, and a source's option beats another only where the error it brings each recompute is no larger too."""
    if o == sixteen:
        return False
    b, e = alike["bytes"][k], alike["errors"][k]
    high = e.copy()  # the most error each option brings, whatever its source's option
    carried = []  # [L, options of k]: the error each of k's options brings a recompute of another kind
    for K, (S, recompute, added) in alike["pairs"].items():
        if K == k:
            high[:, recompute] += added.max(axis=1)
        if S == k:
            carried.append(added)

    def no_worse(j: int, i: int) -> bool:  # option j as good as option i whatever the other kinds' choice
        return bool(b[j] <= b[i] and np.all(high[:, j] <= e[:, i])
                    and all(np.all(c[:, j] <= c[:, i]) for c in carried))

    for j in range(len(b)):
        if j not in (o, sixteen) and no_worse(j, o) and (not no_worse(o, j) or j < o):
            return True
    return False


def settings(m, alike: dict):
    """The settings worth enumerating (every kind's options not `dominated`), built once per model: [settings,
    kinds] option positions, each setting's bytes per layer under LAAQ (the shared-input credit included where
    attention and o_proj_input are both at 16) and its kinds not at 16."""
    cached = getattr(m, "_uniform_settings", None)
    if cached is not None:
        return cached
    kinds, options = alike["kinds"], alike["options"]
    sixteen = {k: options[k].index("16") for k in kinds}
    useful = [np.array([o for o in range(len(options[k])) if not dominated(alike, k, o, sixteen[k])]) for k in kinds]
    grids = np.meshgrid(*useful, indexing="ij")
    choice = np.stack([g.ravel() for g in grids], axis=1)  # [settings, kinds] option positions
    choice = choice[~_beaten_by_recompute(alike, choice, useful, sixteen)]
    per_layer = np.zeros(len(choice))
    non16 = np.zeros(len(choice))
    for j, k in enumerate(kinds):
        per_layer += alike["bytes"][k][choice[:, j]]
        non16 += choice[:, j] != sixteen[k]
    att, oproj = KINDS.index("attention"), KINDS.index("o_proj_input")
    if att in kinds and oproj in kinds and m.bounds.ub[m.w0] > 0:
        both = (choice[:, kinds.index(att)] == sixteen[att]) & (choice[:, kinds.index(oproj)] == sixteen[oproj])
        per_layer += np.where(both, float(m.memory_rows[0][m.w0]), 0.0)
    m._uniform_settings = (choice, per_layer, non16)
    return m._uniform_settings


def _beaten_by_recompute(alike: dict, choice: np.ndarray, useful: list, sixteen: dict) -> np.ndarray:
    """[settings] bool: settings that store a recomputable kind K at some bits where the same setting with K
    recomputed instead keeps no more bytes and no more error in any layer, given its source's option in the setting
    (ChoiceProblem.pair_options): never needed, as `dominated`'s options, but jointly with the source (a recompute
    from a source at fewer bits than K's own carries more error than K stored). Ties keep the recompute."""
    kinds, out = alike["kinds"], np.zeros(len(choice), dtype=bool)
    for K, (S, recompute, added) in alike["pairs"].items():
        jK, jS = kinds.index(K), kinds.index(S)
        if recompute not in useful[jK]:
            continue
        b, e = alike["bytes"][K], alike["errors"][K]  # [options of K], [L, options of K]
        # [options of K, options of S]: K recomputed from S at that option is as good as K stored at this one
        beaten = (b[recompute] <= b)[:, None] & np.all(e[:, recompute, None, None] + added[:, None, :]
                                                       <= e[:, :, None], axis=0)
        beaten[[recompute, sixteen[K]], :] = False
        out |= beaten[choice[:, jK], choice[:, jS]]
    return out


def _cap_below(per_layer: np.ndarray, room: float, L: int) -> np.ndarray:
    """Per setting, the most layers under LAAQ (`per_layer` bytes each) the highest checkpointed layer's backward
    has room for below it (-1: not even none)."""
    safe = np.where(per_layer > 0, per_layer, 1.0)
    cap = np.where(per_layer > 0, np.floor(room / safe), np.where(room >= 0, L, -1))
    return np.clip(cap, -1, L).astype(int)


def _capped_least(e: np.ndarray, cap: np.ndarray, n_a: int, n_c: int, height: np.ndarray):
    """Per column of `e` ([L, settings] errors): the least total error of n_a layers under LAAQ with at most cap of
    them among the lowest n_c + cap layers (so that n_c checkpointed layers fit below them: module docstring), inf
    where none; and for a single column, the layers of that optimum. Greedy over the two groups is exact (a
    capacity on one group is a partition matroid)."""
    L = e.shape[0]
    window = np.clip(n_c + cap, 0, L)
    inside = height < window[None, :]
    low = np.sort(np.where(inside, e, np.inf), axis=0)
    high = np.sort(np.where(inside, np.inf, e), axis=0)
    zero = np.zeros((1, e.shape[1]))
    low_sum = np.concatenate([zero, np.cumsum(low, axis=0)])
    high_sum = np.concatenate([zero, np.cumsum(high, axis=0)])
    total = np.full(e.shape[1], np.inf)
    best_j = np.zeros(e.shape[1], dtype=int)
    for j in range(0, n_a + 1):
        t = np.where((j <= cap) & (cap >= 0), low_sum[j] + high_sum[n_a - j], np.inf)
        better = t < total
        total, best_j = np.where(better, t, total), np.where(better, j, best_j)
    layers = None
    if e.shape[1] == 1 and np.isfinite(total[0]):
        j, col, w = int(best_j[0]), e[:, 0], int(window[0])
        lows = np.argsort(np.where(np.arange(L) < w, col, np.inf), kind="stable")[:j]
        highs = np.argsort(np.where(np.arange(L) < w, np.inf, col), kind="stable")[:n_a - j]
        layers = np.concatenate([lows, highs]).astype(int)
    return total, layers


def _nested_caps(per_layer: np.ndarray, room: float, n_c: int, c_bytes: float, g: float, L: int) -> np.ndarray:
    """[n_c, settings]: cap_i of the module docstring (-1: the i-th checkpointed layer does not fit even with none
    below), for `room` = budget - static - transient - r(0) and per-setting bytes `per_layer` (all > g)."""
    i = np.arange(n_c, dtype=float)[:, None]
    free = room - (i + 1) * c_bytes + i * g  # [n_c, 1]
    cap = np.floor(free / (per_layer[None, :] - g))
    return np.clip(cap, -1, L).astype(int)


def _nested_most(caps: np.ndarray, L: int) -> np.ndarray:
    """Per column of `caps` ([n_c, settings], as `_nested_caps` gives them): the most layers of L that can be taken
    with at most caps[i] of them among the lowest w_i = min(L, i + caps[i] + 1) for every i, -1 where some cap is
    negative. A set A meeting the caps has |A| = |A in window i| + |A above it| <= caps[i] + L - w_i for every i,
    and at most L; on prefixes (a chain) that least bound is met, taking the layers highest first."""
    if caps.shape[0] == 0:
        return np.full(caps.shape[1], L, dtype=int)
    w = np.minimum(L, np.arange(caps.shape[0])[:, None] + caps + 1)
    most = np.minimum(L, (caps + L - w).min(axis=0))
    return np.where((caps >= 0).all(axis=0), most, -1)


def _nested_least(e: np.ndarray, caps: np.ndarray, n_a: int):
    """Per column of `e` ([L, settings] errors): the least total error of n_a layers under LAAQ with at most caps[i]
    of them among the lowest i + caps[i] + 1 layers for every i, inf where none (greedy by error: exact on a laminar
    matroid); for a single column also the layers. Columns where fewer than n_a layers meet the caps at all
    (`_nested_most`) are inf without the greedy."""
    L, S = e.shape
    possible = _nested_most(caps, L) >= n_a
    if S > 1 and not possible.all():
        total = np.full(S, np.inf)
        if possible.any():
            total[possible] = _nested_least(e[:, possible], caps[:, possible], n_a)[0]
        return total, None
    n_c = caps.shape[0]
    ends = np.arange(n_c)[:, None] + caps  # [n_c, S] the highest layer of each window
    order = np.argsort(e, axis=0, kind="stable")  # [L, S]
    counts = np.zeros((n_c, S), dtype=int)
    taken = np.zeros(S, dtype=int)
    total = np.zeros(S)
    picked = np.zeros((L, S), dtype=bool)
    columns = np.arange(S)
    for t in range(L):
        x = order[t]
        inside = x[None, :] <= ends
        ok = np.all(~inside | (counts + 1 <= caps), axis=0) & (taken < n_a)
        counts += inside & ok[None, :]
        taken += ok
        total += np.where(ok, e[x, columns], 0.0)
        picked[x[ok], columns[ok]] = True
    total = np.where((taken == n_a) & np.all(caps >= 0, axis=0), total, np.inf)
    layers = np.nonzero(picked[:, 0])[0] if S == 1 and np.isfinite(total[0]) else None
    return total, layers


def tie_break(m, best_seconds: float, counts: list, budgets: np.ndarray, error_cap: Optional[float],
              error_weight: float, change_weight: float, prove_none: bool = False) -> Optional[OptimizeResult]:
    """The second objective's optimum over the choices of the one tied level in `counts` ((n_u, n_c) pairs) of the
    model `m` (agoq.search.milp_model.Model), weighed as it weighs them: error x `error_weight` + changed tensors x
    `change_weight`; None where the enumeration does not apply (then the MILP answers). The choice is checked with
    the problem's own `evaluate` (it fits the budget, at `best_seconds`) before it is returned. `prove_none`: where
    the enumeration applies and no setting fits the budget and the error cap, say so (x None, status 2) rather
    than None."""
    none = OptimizeResult(x=None, status=2, success=False, fun=None, mip_gap=None,
                          message="no choice of the level fits (every LAAQ setting enumerated)") if prove_none else None
    if len(counts) != 1:
        return None
    n_u, n_c = counts[0]
    if n_u is None or n_c < 0:
        return None
    alike = _alike(m)
    if alike is None:
        return None
    p, L = m.p, m.L
    n_a = L - n_u - n_c
    if n_a <= 0:
        return None  # nothing to choose: the MILP's answer is immediate
    reruns = p.recomputed()
    g = float(reruns[0] - reruns[1]) if L > 1 else 0.0  # what each layer of height saves a checkpointed layer
    if n_c > 0 and (not p.allow_checkpoint or np.ptp(p.checkpoint_seconds) > 0
                    or np.asarray(p.in_flight_counts(), float).max() != 1 or g < 0
                    or np.abs(reruns - (reruns[0] - g * np.arange(L))).max() > 1e-6 * max(1.0, abs(reruns[0]))):
        return None
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
    c_bytes = float(mem[m.c0])  # a checkpointed layer's input (and its calibration), alike in every layer
    if n_c > 0 and (c_bytes > u_bytes or (g > 0 and u_bytes < g)):
        return None  # the placement below assumes a checkpointed layer keeps no more than an unmodified one
    rerun = float(reruns[0]) if n_c > 0 else 0.0
    budget = float(np.asarray(budgets, float)[0])
    transient = float(mem[m.z0]) if n_a > 0 else 0.0
    # the model's rows are in its own unit: the same tolerance as its constraint (HiGHS's 1e-7 feasibility)
    tolerance = 1e-7 * m.unit
    room = budget - float(p.static_bytes[0]) - n_u * u_bytes - n_c * c_bytes - transient + tolerance
    # the highest checkpointed layer's backward: the layers under LAAQ below it, the n_c inputs, its rerun
    ckpt_room = budget - float(p.static_bytes[0]) - n_c * c_bytes - rerun - transient + tolerance
    choice, per_layer, non16 = settings(m, alike)
    fits = (n_a * per_layer <= room) & (non16 > 0)  # a layer under LAAQ changes some kind
    candidates = np.nonzero(fits)[0]
    if len(candidates) == 0:
        return none
    nested = n_c > 0 and g > 0
    if nested and per_layer[candidates].min() <= g:
        return None  # a setting whose layers keep less than a layer of height saves: the MILP decides
    nested_room = ckpt_room + n_c * c_bytes  # the same room before the checkpointed inputs (cap_i counts them)
    height = np.arange(L)[:, None]

    def errors(ys: np.ndarray) -> np.ndarray:  # [L, settings]: each layer's error at each setting
        return setting_errors(alike, choice, ys, L)

    def valued(total: np.ndarray, ys: np.ndarray) -> np.ndarray:
        value = error_weight * total + change_weight * (n_a * non16[ys] + n_c)
        if error_cap is not None:
            value = np.where(total <= error_cap * (1 + 1e-9) + 1e-15, value, np.inf)
        return value

    # a lower bound on every setting's value, kind by kind: the n_a least errors of each kind's option, summed over
    # the kinds (no more than the n_a least of the layers' sums, which pairs only raise); exact values only where the
    # bound could win
    least_of = {k: np.sort(alike["errors"][k], axis=0)[:n_a].sum(axis=0) for k in kinds}  # [options] per kind
    bound_total = np.zeros(len(candidates))
    for j, k in enumerate(kinds):
        bound_total += least_of[k][choice[candidates, j]]
    bound = valued(bound_total, candidates)
    best_value, best_y, best_layers = np.inf, None, None

    def settle(ys: np.ndarray) -> None:
        nonlocal best_value, best_y, best_layers
        if nested:  # the settings whose capacities leave room for n_a layers at all: their errors only
            caps = _nested_caps(per_layer[ys], nested_room, n_c, c_bytes, g, L)
            possible = np.nonzero(_nested_most(caps, L) >= n_a)[0]
            value = np.full(len(ys), np.inf)
            if len(possible):
                total = _nested_least(errors(ys[possible]), caps[:, possible], n_a)[0]
                value[possible] = valued(total, ys[possible])
            i = int(np.argmin(value))
            if value[i] < best_value:
                best_value, best_y = float(value[i]), int(ys[i])
                best_layers = _nested_least(errors(ys[i:i + 1]), caps[:, i:i + 1], n_a)[1]
            return
        e = errors(ys)
        if n_c == 0:
            least = np.partition(e, n_a - 1, axis=0)[:n_a] if n_a < L else e
            value = valued(least.sum(axis=0), ys)
        else:
            value = valued(_capped_least(e, _cap_below(per_layer[ys], ckpt_room, L), n_a, n_c, height)[0], ys)
        i = int(np.argmin(value))
        if value[i] < best_value:
            best_value, best_y = float(value[i]), int(ys[i])
            if n_c == 0:
                best_layers = np.argsort(e[:, i], kind="stable")[:n_a]
            else:
                cap = _cap_below(per_layer[ys[i:i + 1]], ckpt_room, L)
                best_layers = _capped_least(e[:, i:i + 1], cap, n_a, n_c, height)[1]

    first = np.argpartition(bound, CHUNK)[:CHUNK] if len(bound) > CHUNK else np.arange(len(bound))
    settle(candidates[first])
    rest = np.setdiff1d(np.nonzero(bound < best_value)[0], first, assume_unique=True)
    rest = rest[np.argsort(bound[rest], kind="stable")]
    for start in range(0, len(rest), CHUNK):
        if not bound[rest[start]] < best_value:
            break
        settle(candidates[rest[start:start + CHUNK]])
    if best_y is None or not np.isfinite(best_value):
        return none
    x = np.zeros(m.nv)
    laaq = np.zeros(L, dtype=bool)
    laaq[best_layers] = True
    ckpt = np.zeros(L, dtype=bool)
    ckpt[np.nonzero(~laaq)[0][:n_c]] = True  # the lowest places A leaves free
    for l in range(L):
        if ckpt[l]:
            continue
        for j, k in enumerate(kinds):
            pos = choice[best_y, j] if laaq[l] else sixteen[k]
            x[int(alike["index"][(l, k)][pos])] = 1.0
    x[m.u0:m.u0 + L] = ~laaq & ~ckpt
    x[m.c0:m.c0 + L] = ckpt
    x[m.z0] = float(laaq.any())  # some layer runs LAAQ's functions (one stage)
    if att in kinds and oproj in kinds:  # attention and o_proj_input both at 16: o_proj's input is shared
        both16 = ~ckpt & (~laaq | bool(choice[best_y, kinds.index(att)] == sixteen[att]
                                       and choice[best_y, kinds.index(oproj)] == sixteen[oproj]))
        x[m.w0:m.w0 + L] = both16 & (m.bounds.ub[m.w0:m.w0 + L] > 0)
    figures = p.evaluate(np.nonzero(x[:m.n])[0], ckpt)
    if max(figures["peak_bytes_per_stage"]) > budget or \
            abs(figures["step_seconds"] - best_seconds) > abs(best_seconds) * 1e-9 + 1e-12:
        return None  # not what the model prices it at: leave it to the MILP
    return OptimizeResult(x=x, status=0, success=True, fun=best_value, mip_gap=0.0,
                          message="optimal: the least error, then fewest changes, of every LAAQ setting of the level")


__all__ = ["tie_break"]
