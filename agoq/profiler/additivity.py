"""Predicting the gradient error of a mixed policy from single-(layer, kind) sensitivities.

Each option perturbs the weight gradients on its own; the perturbations of different layers and kinds
are nearly uncorrelated, so their norms add in quadrature: sqrt(sum of squared sensitivities) predicts
the measured error of the mixed policy closely, and the plain sum is an upper bound (triangle
inequality) that overestimates by up to about sqrt(number of quantized kinds).

Measured on llama-tiny (3 layers, fp32, 2 x 64 tokens, random mixes of 2..8 bits; tests/profiler/
test_additivity.py keeps checking it):
- without recompute, measured / quadrature was 0.98 .. 1.09;
- with recompute in the mix, up to 1.58: recomputing from a quantized source (qkv_input from a 4-bit
  norm_input) adds the source's error a second time, which single-kind runs (source at 16) cannot see;
- measured <= sum always; sum / measured was 1.26 .. 2.82.
"""

from __future__ import annotations

import math

from agoq.runtime.activations.policy import KINDS, RECOMPUTE, as_policy

QUADRATURE_FACTOR = 1.25  # without recompute: quadrature / F <= measured <= quadrature * F
QUADRATURE_FACTOR_WITH_RECOMPUTE = 2.0  # the same bound when the mix recomputes from quantized sources
SUM_FACTOR = 3.5  # sum / F <= measured <= sum, for models of a few layers; grows like sqrt(#terms)


def option_key(setting) -> str:
    """The profile's `option` text of a policy setting."""
    return RECOMPUTE if setting == RECOMPUTE else str(int(setting))


def predicted_error(table, policy, num_layers: int, how: str = "quadrature") -> float:
    """Predicted gradient error of `policy` from a profile table (pandas DataFrame or list of row dicts):
    "quadrature" sqrt(sum s^2) (the estimate) or "sum" (the upper bound). Rows of the policy's format
    are used for 4-bit settings; raises KeyError if a needed row is missing."""
    policy = as_policy(policy)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    fmt = policy.format
    lookup = {}
    for r in rows:
        if r["format"] in (fmt, "bf16", "recompute") or (r["format"] == "int" and r["bits"] != 4):
            lookup[(int(r["layer"]), r["kind"], str(r["option"]))] = float(r["sensitivity"])
    terms = [lookup[(i, k, option_key(policy.settings(i)[k]))] for i in range(num_layers) for k in KINDS]
    if how == "sum":
        return sum(terms)
    if how == "quadrature":
        return math.sqrt(sum(t * t for t in terms))
    raise ValueError(f"how must be 'quadrature' or 'sum', got {how!r}")
