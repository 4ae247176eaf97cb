"""The error a recompute option brings back from its quantized source, as the search counts it: the term of
agoq.profiler.additivity, as pairs of options of a ChoiceProblem.

A kind K recomputed in backward (agoq.runtime.activations.policy.RECOMPUTABLE: qkv_input and ffn1_input from
norm_input, ffn2_input from silu_input, all of one layer i) is rebuilt by the forward's own function from its source
S's stored copy. With S kept at 16 the rebuild is exact and the option adds no error (agoq.search.cost_model prices
it at 0). With S stored at b bits the rebuild starts from S's dequantized copy and carries S's error again; the term
is (agoq.profiler.additivity's module docstring says why, and what it measured)

    t(i, K, b) = s(i, K, b)   K's own sensitivity stored at b bits (relative L2 of the weight gradients), from the
                              row the search prices K at b bits with: the plan's format at 4 bits, nf4 where the
                              profile measured it, else int (agoq.search.cost_model._option_rows), whatever floors
                              or attention's switch leave out of K's own options
               = s(i, S, b)   where the profile has no row of K at b bits (the source's own option's error)

so a choice's predicted error is sum_options error + sum over (i, K) recomputed of t(i, K, bits of S in layer i),
which is agoq.profiler.additivity.predicted_error(..., how="sum") of the policy, but for the profile's `recompute`
rows, which the search counts as 0 (a GPU profile's are the noise of two runs, not an error of the option). The term
is a product of two choices, x[i, K, recompute] x x[i, S, b]: `recompute_pairs` lists it as pairs of option indices
(ChoiceProblem.pair_options, pair_error), one per (layer, K, b) whose t > 0 and whose two options are both offered.
"""

from __future__ import annotations

import math

import numpy as np

from agoq.runtime.activations.policy import KINDS, RECOMPUTABLE, RECOMPUTE

__all__ = ["kind_sensitivities", "recompute_pairs"]


def kind_sensitivities(table, fmt: str) -> dict[tuple[int, str, str], float]:
    """(layer, kind, option) -> sensitivity of the recomputable kinds' quantized rows, the row the search prices each
    at (module docstring): format int, and at 4 bits nf4 instead where `fmt` is nf4 and the profile measured it for
    that (layer, kind). Missing or not finite sensitivities are left out."""
    kinds = table["kind"].tolist()
    wanted = [k in RECOMPUTABLE for k in kinds]
    layers = table["layer"].to_numpy(int)
    forms, options = table["format"].tolist(), [str(o) for o in table["option"].tolist()]
    values = table["sensitivity"].to_numpy(float)
    has_nf4 = {(int(l), k) for l, k, f, w in zip(layers, kinds, forms, wanted) if w and f == "nf4"} \
        if fmt == "nf4" else set()
    out = {}
    for l, k, f, o, s, w in zip(layers, kinds, forms, options, values, wanted):
        if not w or not math.isfinite(s) or o in ("16", RECOMPUTE):
            continue
        nf4_here = (int(l), k) in has_nf4 and o == "4"
        if (f == "int" and not nf4_here) or (f == "nf4" and nf4_here):
            out.setdefault((int(l), k, o), float(s))
    return out


def recompute_pairs(profile, fmt: str, options: dict) -> dict:
    """{"pair_options": [m, 2] option indices (a recompute option of kind K in layer i, a quantized option of K's source
    S in layer i), "pair_error": [m] t(i, K, b) of the module docstring} for a ChoiceProblem's options (`options`:
    arrays "layer", "kind" (index into KINDS), "option" (str) and "error", whose source options' errors are the
    fallback); only pairs with t > 0. `profile`: its table gives s(i, K, b) (a ProfileData, whose `cache` keeps the
    lookup per format)."""
    layer, kind, error = np.asarray(options["layer"]), np.asarray(options["kind"]), options["error"]
    option = np.asarray(options["option"], dtype=object)
    cache = profile.cache.setdefault("recompute_sensitivities", {})
    key = (id(profile.table), fmt)
    if key not in cache:
        cache[key] = kind_sensitivities(profile.table, fmt)
    lookup = cache[key]
    quantized = (option != "16") & (option != RECOMPUTE)
    pairs, terms = [], []
    for recomputed, source in RECOMPUTABLE.items():
        rs = np.nonzero((kind == KINDS.index(recomputed)) & (option == RECOMPUTE))[0]
        bs = np.nonzero((kind == KINDS.index(source)) & quantized)[0]
        for r, b in zip(*np.nonzero(layer[rs][:, None] == layer[bs][None, :])):  # same layer
            r, b = int(rs[r]), int(bs[b])
            t = lookup.get((int(layer[r]), recomputed, option[b]), float(error[b]))
            if t > 0:
                pairs.append((r, b))
                terms.append(t)
    return {"pair_options": np.array(pairs, dtype=int).reshape(-1, 2), "pair_error": np.array(terms, dtype=float)}
