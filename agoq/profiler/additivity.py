"""Predicting the gradient error of a mixed policy from single-(layer, kind) sensitivities.

Each option perturbs the weight gradients on its own; the perturbations of different layers and kinds
are nearly uncorrelated, so their norms add in quadrature: sqrt(sum of squared terms) predicts the
measured error of the mixed policy closely, and the plain sum is an upper bound (triangle inequality)
that overestimates by up to about sqrt(number of terms).

The terms. A kind stored at b bits (or 16) contributes its measured sensitivity s(i, K, b) (0 at 16).
A kind K recomputed in backward is rebuilt by the forward's own function from its source S = RECOMPUTABLE[K]
of the same layer (agoq.runtime.activations.laaq: qkv_input = RMSNorm(norm_input) in `_NormLinears`,
ffn1_input = RMSNorm(norm_input) likewise, ffn2_input = SiLU(gate) * up from silu_input in `_SwiGLUDown`).
Its sensitivity was measured with S at 16, where the rebuild is exact: 0. With S stored at b bits the
rebuild starts from S's dequantized copy, so K's weight gradients see S's error a second time, which no
single-kind measurement contains. That term is taken as s(i, K, b), the sensitivity of storing K itself
at b bits (in the policy's format at 4 bits):

  RMSNorm is h = x * w / rms(x) row by row, so it is scale-invariant per row. Block quantization's error e
  of x (at most half a step of its block's scale) reaches h as e * w / rms(x), plus the move of rms(x),
  (x . e) / (n rms(x)) to first order: a sum of n roundings of either sign, small next to e itself. That
  is an error shaped like quantizing h itself at b bits (h's blocks are x's blocks times w / rms), up to
  the spread of the norm's weights w within a block. SiLU(g) * u is smooth (|d/dg| <= 1.1 |u|,
  d/du = SiLU(g)), so quantizing g and u at b bits moves the product by about as much as quantizing the
  product at b bits.

So a recompute option of K in layer i counts s(i, K, b) when S is stored at b bits, 0 when S is at 16 (the
sources are never themselves recomputable). If the table has no such row (the profile did not measure K at
b bits), S's own term s(i, S, b) counts a second time instead. The same terms feed both "quadrature"
and "sum"; the search counts the same term in its predicted error (agoq.search.recompute_error).

Measured on llama-tiny (3 layers, fp32, 2 batches of 2 x 20..40 tokens, random mixes of 2, 3, 5, 8 bits and
16, with or without recompute among the choices, plus one policy recomputing every recomputable kind of one
layer from sources at 2 or 3 bits): tests/profiler/test_additivity.py's procedure, 7 policies per seed over
its seeds 1..200 (1400 policies; the test keeps checking these bounds on fresh seeds):
- with recompute in the mix (800 policies), measured / quadrature was 0.92 .. 1.33, hence
  QUADRATURE_FACTOR_WITH_RECOMPUTE = 1.5. Before the recompute term it was 0.96 .. 3.70: a policy rebuilding
  qkv_input from a 2-bit norm_input measured 2.4x the estimate (test seed 19), and up to 2.6x the sum;
- without recompute (600 policies), 0.92 .. 1.19 but for 4 of the 200 seeds (1.28 .. 2.02): mixes with
  norm_input at 2 bits in several layers, where a single layer's error is already 0.1 .. 0.44. There the
  errors compound instead of adding (norm_input at 2 bits in all 3 layers of such a model measured 0.97
  against a sum of 0.67: there not even the sum bounds it). Those four had quadratures 0.24 .. 0.53; their
  ratio stayed under 1 + 2 x quadrature (the largest, 2.02 at 0.53), so the upper bound is
  quadrature x max(F, 1 + COMPOUNDING x quadrature) with COMPOUNDING = 2.5 (`upper_factor`): the factor F for
  small errors, growing where one perturbation's gradients flow through another's;
- sum / measured was 1.11 .. 3.40 (measured <= sum in all 1400).
"""

from __future__ import annotations

import math

from agoq.runtime.activations.policy import (
    KEEP,
    KINDS,
    RECOMPUTABLE,
    RECOMPUTE,
    as_policy,
)

QUADRATURE_FACTOR = 1.25  # without recompute: quadrature / F <= measured <= quadrature * F
QUADRATURE_FACTOR_WITH_RECOMPUTE = 1.5  # the same bound when the mix recomputes (the module docstring)
SUM_FACTOR = 4.0  # sum / F <= measured <= sum, for models of a few layers; grows like sqrt(#terms)
COMPOUNDING = 2.5  # large errors compound: measured <= quadrature x (1 + COMPOUNDING x quadrature) (docstring)


def upper_factor(quadrature: float, factor: float) -> float:
    """How far above the quadrature estimate the measured error may be: `factor` (QUADRATURE_FACTOR or
    QUADRATURE_FACTOR_WITH_RECOMPUTE) for small errors, 1 + COMPOUNDING x quadrature where errors compound."""
    return max(factor, 1.0 + COMPOUNDING * quadrature)


def option_key(setting) -> str:
    """The profile's `option` text of a policy setting."""
    return RECOMPUTE if setting == RECOMPUTE else str(int(setting))


def _sensitivities(rows, fmt: str) -> dict:
    """(layer, kind, option text) -> sensitivity, with the rows of format `fmt` for 4 bits."""
    lookup = {}
    for r in rows:
        if r["format"] in (fmt, "bf16", "recompute") or (r["format"] == "int" and r["bits"] != 4):
            lookup[(int(r["layer"]), r["kind"], str(r["option"]))] = float(r["sensitivity"])
    return lookup


def error_terms(table, policy, num_layers: int) -> dict[tuple[int, str], float]:
    """(layer, kind) -> the gradient error term of that kind under `policy` (the module docstring): the measured
    sensitivity of its setting, and for a recompute option the error its quantized source brings into the rebuilt
    tensor. `table` is a profile table (pandas DataFrame or list of row dicts); raises KeyError if a needed row
    is missing."""
    policy = as_policy(policy)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    lookup = _sensitivities(rows, policy.format)
    terms = {}
    for i in range(num_layers):
        settings = policy.settings(i)
        for k in KINDS:
            term = lookup[(i, k, option_key(settings[k]))]
            source = RECOMPUTABLE.get(k)
            if settings[k] == RECOMPUTE and settings[source] != KEEP:
                bits = option_key(settings[source])
                term = lookup[(i, k, bits)] if (i, k, bits) in lookup else lookup[(i, source, bits)]
            terms[(i, k)] = term
    return terms


def predicted_error(table, policy, num_layers: int, how: str = "quadrature") -> float:
    """Predicted gradient error of `policy` from a profile table (pandas DataFrame or list of row dicts):
    "quadrature" sqrt(sum t^2) (the estimate) or "sum" (the upper bound) of `error_terms`. Rows of the policy's
    format are used for 4-bit settings; raises KeyError if a needed row is missing."""
    if how not in ("quadrature", "sum"):
        raise ValueError(f"how must be 'quadrature' or 'sum', got {how!r}")
    terms = error_terms(table, policy, num_layers).values()
    if how == "sum":
        return sum(terms)
    return math.sqrt(sum(t * t for t in terms))
