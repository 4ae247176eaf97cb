"""The error of a mixed policy from single-(layer, kind) sensitivities, within the documented factors.

Besides random mixes, one policy rebuilds every recomputable kind of one layer from its source stored at 2 or 3
bits: the error that brings into the rebuilt tensors is most of its error, which single-kind measurements (source at 16)
do not contain, so a prediction that priced those recomputes at 0 would fall far below the measured error."""

import math
import random

from agoq.runtime.activations.policy import KEEP, KINDS, RECOMPUTABLE, RECOMPUTE, ActivationPolicy
from agoq.profiler.additivity import (
    QUADRATURE_FACTOR,
    QUADRATURE_FACTOR_WITH_RECOMPUTE,
    SUM_FACTOR,
    error_terms,
    predicted_error,
    upper_factor,
)
from agoq.profiler.model_source import load_model, token_batches
from agoq.profiler.options import kind_options
from agoq.profiler.sensitivity import Measurement, SensitivityMeter


TRIALS = 6  # random mixed policies, each one checked; the last half with recompute among the choices


def _mixed_layer(rng: random.Random, bits: list[int], with_recompute: bool) -> dict:
    """One layer's random settings, drawn again while they would keep every kind in 16 bits (such a layer
    runs unmodified: it would test nothing)."""
    while True:
        choice = {}
        for kind in KINDS:
            opts = [o.setting for o in kind_options(kind, bits, ["int"]) if with_recompute or o.setting != RECOMPUTE]
            choice[kind] = rng.choice(opts)
        if any(v != KEEP for v in choice.values()):
            return choice


def _recompute_from_quantized(rng: random.Random, layers: int) -> dict:
    """Per-layer settings: in one random layer each recomputable kind is rebuilt from its source stored at 2 or 3
    bits; the other layers only recompute ffn2_input from 16-bit silu_input (exact: their error is 0, but they
    run through LAAQ as the reference does)."""
    chosen = rng.randrange(layers)
    out = {layer: {"ffn2_input": RECOMPUTE} for layer in range(layers)}
    out[chosen] = {kind: RECOMPUTE for kind in RECOMPUTABLE}
    out[chosen].update({source: rng.choice([2, 3]) for source in sorted(set(RECOMPUTABLE.values()))})
    return out


def test_mixed_policies_within_factor(seed):
    rng = random.Random(seed)
    model = load_model("llama-tiny", dtype="fp32", seed=rng.randint(0, 999))
    meter = SensitivityMeter(model, token_batches(256, 2, 2, rng.randint(20, 40), rng.randint(0, 999), "cpu"))
    bits = [2, 3, 5, 8]
    rows = []
    for layer in range(3):
        for kind in KINDS:
            for o in kind_options(kind, bits, ["int"]):
                s = meter.measure(Measurement(layer, kind, o.option, o.format))
                rows.append({"layer": layer, "kind": kind, "option": o.option, "bits": o.bits, "format": o.format,
                             "sensitivity": s})
    for trial in range(TRIALS + 1):
        with_recompute = trial >= TRIALS // 2
        if trial == TRIALS:
            policy = ActivationPolicy(layers=_recompute_from_quantized(rng, 3))
        else:
            policy = ActivationPolicy(layers={layer: _mixed_layer(rng, bits, with_recompute) for layer in range(3)})
        assert not any(policy.keeps_everything(i) for i in range(3))
        measured = meter.policy_error(policy)
        quad = predicted_error(rows, policy, 3)
        total = predicted_error(rows, policy, 3, how="sum")
        factor = QUADRATURE_FACTOR_WITH_RECOMPUTE if with_recompute else QUADRATURE_FACTOR
        assert quad / factor <= measured <= quad * upper_factor(quad, factor), (trial, quad, measured)
        assert total / SUM_FACTOR <= measured <= total * 1.02, (trial, total, measured)


def test_recompute_terms_from_the_source_setting(seed):
    """A recompute counts its kind's own row at its source's setting (nf4's row at 4 bits under an nf4 policy), 0 with
    the source at 16, and the source's row a second time where its own row is missing."""
    rng = random.Random(seed)
    rows = [{"layer": layer, "kind": kind, "option": o.option, "bits": o.bits, "format": o.format,
             "sensitivity": 0.0 if o.option in ("16", RECOMPUTE) else rng.uniform(0.01, 0.3)}
            for layer in range(2) for kind in KINDS for o in kind_options(kind, [2, 4], ["int", "nf4"])]
    s = {(r["layer"], r["kind"], r["option"], r["format"]): r["sensitivity"] for r in rows}
    layers = {0: {"norm_input": 4, "qkv_input": RECOMPUTE, "ffn1_input": RECOMPUTE, "silu_input": 2,
                  "ffn2_input": RECOMPUTE},
              1: {"norm_input": KEEP, "qkv_input": RECOMPUTE, "silu_input": 2, "ffn2_input": RECOMPUTE}}
    policy = ActivationPolicy(layers=layers, format="nf4")
    terms = error_terms(rows, policy, 2)
    assert terms[(0, "qkv_input")] == s[(0, "qkv_input", "4", "nf4")]
    assert terms[(0, "ffn1_input")] == s[(0, "ffn1_input", "4", "nf4")]
    assert terms[(0, "ffn2_input")] == s[(0, "ffn2_input", "2", "int")]
    assert terms[(1, "qkv_input")] == 0.0  # its source kept at 16: rebuilt exactly
    assert terms[(1, "ffn2_input")] == s[(1, "ffn2_input", "2", "int")]
    expected = [s[(0, "norm_input", "4", "nf4")], s[(0, "qkv_input", "4", "nf4")], s[(0, "ffn1_input", "4", "nf4")],
                s[(0, "silu_input", "2", "int")], s[(0, "ffn2_input", "2", "int")], s[(1, "silu_input", "2", "int")],
                s[(1, "ffn2_input", "2", "int")]]
    assert math.isclose(predicted_error(rows, policy, 2, how="sum"), sum(expected))
    assert math.isclose(predicted_error(rows, policy, 2), math.sqrt(sum(t * t for t in expected)))
    missing = [r for r in rows if not (r["layer"] == 0 and r["kind"] == "ffn2_input" and r["option"] == "2")]
    assert error_terms(missing, policy, 2)[(0, "ffn2_input")] == s[(0, "silu_input", "2", "int")]
