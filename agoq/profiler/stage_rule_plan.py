"""A plan without a search: the agoq-paper policy with each pipeline stage's bits from the stage rule.

Stage i holding N_i micro-batches in flight (1F1B, from the profile's pipeline section) stores its
quantized kinds at max(4, floor(4 N_1 / N_i)) bits (agoq.activations.policy.stage_aware_policy); with
one stage this is agoq-paper. The predictions come from the profile: bytes per (layer, kind,
option), sensitivities added in quadrature (agoq.profiler.additivity), and the bf16 step plus each
option's extra seconds.
"""

from __future__ import annotations

import datetime

from agoq.activations.activation_bytes import LayerShape
from agoq.activations.policy import KINDS, RECOMPUTE, stage_aware_policy
from agoq.profiler.options import Option, option_bytes


def _option_of(setting) -> Option:
    if setting == RECOMPUTE:
        return Option(RECOMPUTE, 0, RECOMPUTE)
    if setting == 16:
        return Option("16", 16, "bf16")
    return Option(str(setting), int(setting), "int")


def stage_rule_plan(header: dict, table, shape: LayerShape, budget_bytes: int | None, profile_dir: str) -> dict:
    """A plan dict in docs/formats.md's Plan format from a profile (header dict, pandas table or None)."""
    pipeline = header["pipeline"]
    num_layers = header["model"]["num_layers"]
    in_flight = pipeline["in_flight"]["1f1b"]
    layer_stage = pipeline["layer_stage"]
    block = header["settings"]["block"]
    policy = stage_aware_policy(in_flight, num_layers, layer_stage, block=block)
    stages = len(in_flight)
    lookup = {}
    if table is not None:
        for row in table.itertuples(index=False):
            if row.format in ("int", "bf16", "recompute"):
                lookup[(row.layer, row.kind, row.option)] = (row.sensitivity, row.extra_seconds)
    act_per_stage = [0] * stages
    grad_error, extra, known = 0.0, 0.0, True
    layers = []
    for i in range(num_layers):
        settings = policy.settings(i)
        s = layer_stage[i]
        layer_bytes = 0
        for kind in KINDS:
            option = _option_of(settings[kind])
            layer_bytes += option_bytes(shape, kind, option, block)[0]
            measured = lookup.get((i, kind, option.option))
            if measured is None:
                known = False
            else:
                grad_error += measured[0] ** 2
                extra += measured[1]
        act_per_stage[s] += layer_bytes * in_flight[s]
        layers.append({"layer": i, "stage": s, "checkpoint": False, "kinds": dict(settings)})
    memory = header.get("memory", {})
    static = (memory.get("weights_bytes", 0) + memory.get("gradients_bytes_bf16", 0)
              + memory.get("optimizer_bytes_adamw", 0))
    fixed = memory.get("fixed_bytes") or 0
    outside = memory.get("outside_activation_bytes") or 0  # embedding, final norm, LM head, loss
    layers_per_stage = [layer_stage.count(s) for s in range(stages)]
    # rough split for pipelines: static bytes in proportion to layers, the outside part on stage 0
    peak = [int(static * layers_per_stage[s] / num_layers + act_per_stage[s] + fixed + (outside if s == 0 else 0))
            for s in range(stages)]
    bf16_step = next((st.get("step_seconds") for st in memory.get("steps", []) if st.get("policy") == "bf16"), None)
    plan = {
        "schema": "agoq.plan/1",
        "model": {"name": header["model"]["name"], "fingerprint": header["model"]["fingerprint"]},
        "budget_bytes": budget_bytes,
        "activations": {"block": block, "format": "int", "rounding": "nearest"},
        "layers": layers,
        "gradients": {"mode": "bf16", "block": 256, "bucket_bytes": 25 * 1024 * 1024},
        "pipeline": {"stages": stages, "micro_batches": pipeline["micro_batches"], "schedule": "1f1b"},
        "training": {"micro_batch": header["settings"]["micro_batch"], "seq_len": header["settings"]["seq_len"],
                     "grad_accum": 1},
        "predicted": {"peak_bytes_per_stage": peak, "activation_bytes_per_stage": act_per_stage,
                      "step_seconds": None if bf16_step is None else bf16_step + extra,
                      "grad_error": grad_error ** 0.5 if known else None},
        "measured": None,
        "source": {"method": "stage-rule", "objective": None, "profile": str(profile_dir),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "stage_bits": sorted({int(v) for l in layers for v in l["kinds"].values() if v != RECOMPUTE
                                         and v != 16})},
    }
    return plan
