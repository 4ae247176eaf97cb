"""The error of a mixed policy from single-(layer, kind) sensitivities, within the documented factors."""

import random

from agoq.runtime.activations.policy import KEEP, KINDS, RECOMPUTE, ActivationPolicy
from agoq.profiler.additivity import (
    QUADRATURE_FACTOR,
    QUADRATURE_FACTOR_WITH_RECOMPUTE,
    SUM_FACTOR,
    predicted_error,
)
from agoq.profiler.model_source import load_model, token_batches
from agoq.profiler.options import kind_options
from agoq.profiler.sensitivity import Measurement, SensitivityMeter


TRIALS = 6  # mixed policies, each one checked; the last half with recompute among the choices


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
    for trial in range(TRIALS):
        with_recompute = trial >= TRIALS // 2
        policy = ActivationPolicy(layers={layer: _mixed_layer(rng, bits, with_recompute) for layer in range(3)})
        assert not any(policy.keeps_everything(i) for i in range(3))
        measured = meter.policy_error(policy)
        quad = predicted_error(rows, policy, 3)
        total = predicted_error(rows, policy, 3, how="sum")
        factor = QUADRATURE_FACTOR_WITH_RECOMPUTE if with_recompute else QUADRATURE_FACTOR
        assert quad / factor <= measured <= quad * factor, (trial, quad, measured)
        assert total / SUM_FACTOR <= measured <= total * 1.02, (trial, total, measured)
