"""The probe model's profile as measured on one H200 (experiments/results/search_vs_alternatives.json as committed
with the run of commit c7f29b9; later runs replaced the file), rebuilt from that run's recorded figures, and the three plans the search chose there with their measured steps and peaks.

What the run recorded is used as it is: the eager memory steps (bf16, agoq-paper: step and optimizer seconds,
predicted and measured peaks), the compiled section (bf16, agoq-paper, checkpoint-all, activation_memory_budget
0.5 / 0.1). Two things the run did not record are reconstructed:
  - the per-kind eager extra seconds, uniform over the layers, chosen so that the cost model of that run (before
    the compiled model) gives its recorded predictions: 95.9 ms for the plan keeping 16 bits with qkv_input
    recomputed, 107.4 ms for the plan below compile's smallest peak;
  - a compiled bf16 step at micro-batch 1: the run measured compiled bf16 with the 8-bit AdamW over float32 masters
    and bf16 gradients (the compiled section's own step) at micro-batch 1 x 2 twice, 114.67 and 116.70 ms; one fwd
    + bwd of one sequence is their mean less the optimizer step, halved.
Bytes are the runtime's byte predictor's for the probe's shapes (what the profiler records).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from agoq.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.activations.policy import KINDS, RECOMPUTABLE
from agoq.models import build, fingerprint
from agoq.optim.state_bytes import state_table

MICRO_BATCH, SEQ_LEN, BLOCK = 2, 4096, 128
EAGER_STEPS = [  # profile_memory_steps of the run
    {"policy": "bf16", "measured_peak_bytes": 21201129472, "predicted_peak_bytes": 21201129472,
     "step_seconds": 0.1497533329999925, "optimizer_step_seconds": 0.012423136999998974,
     "predicted_activation_bytes": 12624953364, "measured_peak_bytes_forward_backward": 21201129472,
     "predicted_peak_bytes_forward_backward": 21201129472, "measured_peak_bytes_optimizer_step": 9728153600},
    {"policy": "agoq-paper", "measured_peak_bytes": 12206435328, "predicted_peak_bytes": 12211687424,
     "step_seconds": 0.14034101699999724, "optimizer_step_seconds": 0.022189015999998674,
     "predicted_activation_bytes": 3635511316, "measured_peak_bytes_forward_backward": 12206435328,
     "predicted_peak_bytes_forward_backward": 12211687424, "measured_peak_bytes_optimizer_step": 9701966848}]
COMPILED_STEPS = [
    {"policy": "bf16", "step_seconds": 0.1100319450000029, "optimizer_step_seconds": 0.012494415000006143,
     "peak_bytes_forward_backward": 17542601728, "peak_bytes_optimizer_step": 9689383936, "peak_bytes": 17542601728},
    {"policy": "agoq-paper", "step_seconds": 0.11278316399999255, "optimizer_step_seconds": 0.011467518999992876,
     "peak_bytes_forward_backward": 12087882752, "peak_bytes_optimizer_step": 9722948608, "peak_bytes": 12087882752},
    {"policy": "checkpoint-all", "step_seconds": 0.13159461499999736, "optimizer_step_seconds": 0.012290147999991063,
     "peak_bytes_forward_backward": 10342701056, "peak_bytes_optimizer_step": 9718755328, "peak_bytes": 10342701056}]
BUDGET_POINTS = [
    {"activation_memory_budget": 0.5, "step_seconds": 0.12045165899999688, "optimizer_step_seconds": 0.012943965000005164,
     "peak_bytes_forward_backward": 13366118400, "peak_bytes_optimizer_step": 9683103744, "peak_bytes": 13366118400},
    {"activation_memory_budget": 0.1, "step_seconds": 0.129707365999991, "optimizer_step_seconds": 0.012259549999996011,
     "peak_bytes_forward_backward": 10346894848, "peak_bytes_optimizer_step": 9722949120, "peak_bytes": 10346894848}]
COMPILED_BF16_1X2 = (0.1146684389999848, 0.11669606600000293)  # measured, micro-batch 1 x 2
# reconstructed eager extra seconds per layer (see the module docstring)
EXTRA = {("qkv_input", "recompute"): 1.0e-4, ("ffn1_input", "recompute"): 1.0e-4, ("ffn2_input", "recompute"): 2.5e-4,
         "quantize": 2.1e-4, ("silu_input", "quantize"): 2.36e-4}

_QUANGRAD = {"gradients": "quangrad8", "optimizer": "adamw8bit", "master": "fp32", "compile": "compiled"}
_PAPER_LIKE = {"norm_input": 4, "qkv_input": "recompute", "attention": 16, "o_proj_input": 16,
               "ffn1_input": "recompute", "silu_input": 4, "ffn2_input": "recompute"}
_QKV_ONLY = {k: ("recompute" if k == "qkv_input" else 16) for k in KINDS}
PLANS = {  # label -> knobs, per-layer kinds, measured step seconds, measured peak bytes, budget bytes
    "bf16 fits": ({**_QUANGRAD, "micro_batch": 2, "grad_accum": 1}, [_QKV_ONLY] * 16,
                  0.11175971100001902, 17966724096, 21625152061),
    "only selective checkpointing fits": ({**_QUANGRAD, "micro_batch": 1, "grad_accum": 2}, [_QKV_ONLY] * 16,
                                          0.1202030369999818, 13804841472, 15677001728),
    "below compile's smallest peak": ({**_QUANGRAD, "micro_batch": 1, "grad_accum": 2},
                                      [_PAPER_LIKE] * 10 + [{**_PAPER_LIKE, "norm_input": 16}] * 6,
                                      0.12459224799999902, 11510970880, 10036488002),
}


def _extra(kind: str, option: str) -> float:
    if option == "16":
        return 0.0
    if option == "recompute":
        return EXTRA[(kind, "recompute")]
    return EXTRA.get((kind, "quantize"), EXTRA["quantize"])


def write_probe_profile(folder) -> Path:
    """The probe profile of the module docstring, written to `folder` (docs/formats.md); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    m = build("probe", device="meta")
    cfg = m.config
    L = cfg.num_hidden_layers
    shape = LayerShape.from_config(cfg, MICRO_BATCH, SEQ_LEN, 2)
    rows = []
    for layer in range(L):
        for i, kind in enumerate(KINDS):
            options = [("16", 16, "bf16"), ("8", 8, "int"), ("4", 4, "int")]
            if kind in RECOMPUTABLE:
                options.append(("recompute", 0, "recompute"))
            for option, bits, fmt in options:
                settings = {k: 8 for k in KINDS}
                settings[kind] = "recompute" if option == "recompute" else bits
                nbytes = predict_layer_bytes(shape, settings, BLOCK)[kind]
                sens = 0.0 if bits in (0, 16) else 0.01 * (i + 1) * 2.0 ** (4 - bits)
                rows.append({"layer": layer, "kind": kind, "option": option, "bits": bits, "format": fmt,
                             "shape": f"{MICRO_BATCH}x{SEQ_LEN}x{cfg.hidden_size}",
                             "bytes": 0 if (kind, option) == ("o_proj_input", "16") else nbytes,
                             "bytes_unshared": nbytes, "quant_error": sens / 2, "sqnr_db": float("inf"),
                             "sensitivity": sens, "extra_seconds": _extra(kind, option),
                             "quantize_seconds": float("nan"), "dequantize_seconds": float("nan"),
                             "recompute_seconds": float("nan")})
    pd.DataFrame(rows).to_parquet(folder / "profile.parquet")
    numels = [p.numel() for p in m.parameters()]
    table = state_table(numels, 2)
    params = sum(numels)
    measured = table["optimizers"]["adamw8bit/fp32"]
    static = 2 * params + table["gradients"]["bf16"] + measured["masters"] + measured["moments"]
    plain = sum(predict_layer_bytes(shape, None, BLOCK).values())
    bf16 = EAGER_STEPS[0]
    outside = bf16["predicted_activation_bytes"] - L * plain
    header = {
        "schema": "agoq.profile/1",
        "model": {"spec": "probe", "name": cfg.name, "fingerprint": fingerprint(m), "config": cfg.to_dict(),
                  "num_layers": L, "parameters": params, "weight_bytes": 2 * params},
        "settings": {"seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "dtype": "bf16", "device": "cuda",
                     "bits": [4, 8], "formats": ["int"], "block": BLOCK, "batches": 1, "seed": 0,
                     "pipeline_stages": 1, "micro_batches": 1, "world_size": 1, "budget_bytes": None},
        "hardware": {"device": "cuda", "name": "NVIDIA H200", "memory_bytes": 150109880320, "count": 1,
                     "cpu_count": 16},
        "software": {"agoq": "0+unknown"},
        "date": "2026-11-23T14:30:14+00:00",
        "memory": {"weights_bytes": 2 * params, "master_bytes": measured["masters"],
                   "gradients_bytes_bf16": table["gradients"]["bf16"],
                   "gradients_bytes_quangrad8": table["gradients"]["quangrad8"],
                   "optimizer_bytes_adamw": table["optimizers"]["adamw/fp32"]["moments"],
                   "optimizer_bytes_adamw8bit": measured["moments"], "state": table,
                   "measured_with": {"optimizer": "adamw8bit", "master": "fp32", "gradients": "bf16"},
                   "outside_activation_bytes": outside,
                   "fixed_bytes": bf16["measured_peak_bytes_forward_backward"] - static - bf16["predicted_activation_bytes"],
                   "fixed_bytes_optimizer_step": bf16["measured_peak_bytes_optimizer_step"] - static,
                   "steps": EAGER_STEPS},
        "pipeline": {"stages": 1, "micro_batches": 1, "layer_stage": [0] * L, "in_flight": {"1f1b": [1]}},
        "compiled": {"mode": "default", "per": "decoder layer", "steps": COMPILED_STEPS,
                     "memory_budget_points": BUDGET_POINTS},
        "failures": [],
    }
    (folder / "profile.json").write_text(json.dumps(header, indent=1))
    return folder


def add_micro_batch_one(folder) -> Path:
    """Add the compiled bf16 step at micro-batch 1 (see the module docstring) to the profile in `folder`."""
    folder = Path(folder)
    header = json.loads((folder / "profile.json").read_text())
    opt = COMPILED_STEPS[0]["optimizer_step_seconds"]
    fb1 = (sum(COMPILED_BF16_1X2) / len(COMPILED_BF16_1X2) - opt) / 2
    header["compiled"]["micro_batch_steps"] = [{"policy": "bf16", "micro_batch": 1, "step_seconds": fb1 + opt,
                                                "optimizer_step_seconds": opt}]
    (folder / "profile.json").write_text(json.dumps(header, indent=1))
    return folder
