"""Folders in agoq's formats (docs/formats.md) with random contents, for what the real stages do not
produce in a short test session: a 100k-step run, several ranks and pipeline stages, collective
timings, a validated Pareto front, and files damaged on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

KINDS = ["norm_input", "qkv_input", "attention", "o_proj_input", "ffn1_input", "silu_input", "ffn2_input"]
RECOMPUTABLE = ("qkv_input", "ffn1_input", "ffn2_input")  # the kinds rebuilt in backward from a stored tensor
OPTIONS = ["16", "8", "6", "5", "4", "3", "2", "recompute"]


def write_profile(folder: Path, rng: np.random.Generator, layers: int, fingerprint: str,
                  collectives: bool = True) -> dict:
    """profile.json + profile.parquet (+ collectives.parquet); returns the table as columns."""
    import pandas as pd

    folder.mkdir(parents=True, exist_ok=True)
    meta = {"schema": "agoq.profile/1",
            "model": {"spec": "synthetic", "name": "synthetic", "fingerprint": fingerprint, "config": {},
                      "num_layers": layers, "parameters": 1000, "weight_bytes": 2000},
            "settings": {"seq_len": 32, "micro_batch": 2, "dtype": "bf16", "device": "cpu"},
            "hardware": {"device": "cpu", "name": "cpu", "count": 1}, "software": {},
            "date": "2026-11-21T10:00:00+00:00",
            "memory": {"weights_bytes": 3 * 2**20, "gradients_bytes_bf16": 3 * 2**20,
                       "gradients_bytes_quangrad8": 3 * 2**19, "optimizer_bytes_adamw": 12 * 2**20,
                       "optimizer_bytes_adamw8bit": 3 * 2**20, "fixed_bytes": 2**20,
                       "steps": [{"policy": "bf16", "measured_peak_bytes": 40 * 2**20,
                                  "predicted_peak_bytes": 41 * 2**20, "step_seconds": 0.1}]},
            "pipeline": {"stages": 1, "micro_batches": 1, "layer_stage": [0] * layers},
            "failures": []}
    (folder / "profile.json").write_text(json.dumps(meta))
    rows = {k: [] for k in ("layer", "kind", "option", "bits", "format", "shape", "bytes", "quant_error",
                            "sqnr_db", "sensitivity", "extra_seconds")}
    for layer in range(layers):
        for kind in KINDS:
            for option in OPTIONS:
                bits = 0 if option == "recompute" else int(option)
                err = 0.0 if bits in (0, 16) else float(rng.uniform(0.5, 1.5) * 2.0 ** -bits)
                rows["layer"].append(layer)
                rows["kind"].append(kind)
                rows["option"].append(option)
                rows["bits"].append(bits)
                rows["format"].append("recompute" if bits == 0 else "bf16" if bits == 16 else "int")
                rows["shape"].append("2x32x64")
                rows["bytes"].append(int(4096 * (bits or 0.01) / 16 * rng.uniform(0.9, 1.1)))
                rows["quant_error"].append(err)
                rows["sqnr_db"].append(float("inf") if err == 0 else -20 * np.log10(err))
                rows["sensitivity"].append(0.0 if bits == 16 else float(err * rng.uniform(0.1, 1.0)))
                rows["extra_seconds"].append(float(rng.uniform(0, 1e-4)))
    pd.DataFrame(rows).to_parquet(folder / "profile.parquet")
    if collectives:
        sizes = [2**k for k in range(16, 25, 2)]
        coll = {"op": [], "path": [], "world_size": [], "message_bytes": [], "seconds": []}
        for path in ("nccl-bf16", "quangrad8"):
            for size in sizes:
                coll["op"].append("all_reduce")
                coll["path"].append(path)
                coll["world_size"].append(2)
                coll["message_bytes"].append(size)
                coll["seconds"].append(float(size * rng.uniform(1e-10, 3e-10)))
        pd.DataFrame(coll).to_parquet(folder / "collectives.parquet")
    return rows


def make_plan(rng: np.random.Generator, layers: int, fingerprint: str, stages: int = 1) -> dict:
    """A plan with random choices per layer and kind."""
    choices = [16, 8, 6, 5, 4, 3, 2, "recompute"]
    entries = []
    for layer in range(layers):
        checkpoint = layer == layers - 1  # a layer checkpointed whole keeps every kind at 16 (agoq.formats.plan)
        kinds = {k: 16 if checkpoint else choices[int(rng.integers(len(choices) - (k not in RECOMPUTABLE)))]
                 for k in KINDS}
        entries.append({"layer": layer, "stage": layer * stages // layers, "checkpoint": checkpoint, "kinds": kinds})
    peaks = [int(rng.uniform(20, 30) * 2**20) for _ in range(stages)]
    return {"schema": "agoq.plan/1", "model": {"name": "synthetic", "fingerprint": fingerprint},
            "budget_bytes": 32 * 2**20, "activations": {"block": 128, "format": "int", "rounding": "nearest"},
            "layers": entries, "gradients": {"mode": "quangrad8", "block": 256, "bucket_bytes": 2**20},
            "pipeline": {"stages": stages, "micro_batches": 4, "schedule": "1f1b"},
            "training": {"micro_batch": 2, "seq_len": 32, "grad_accum": 1},
            "predicted": {"peak_bytes_per_stage": peaks,
                          "activation_bytes_per_stage": [int(p * 0.3) for p in peaks],
                          "step_seconds": 0.05, "grad_error": 0.04},
            "measured": {"peak_bytes_per_stage": [int(p * 1.05) for p in peaks], "step_seconds": 0.055,
                         "loss_deviation": 0.01, "date": "2026-11-21"},
            "source": {"method": "milp", "objective": "error", "profile": "profile", "date": "2026-11-21"}}


def write_run(folder: Path, rng: np.random.Generator, steps: int, ranks: int = 1, plan: dict | None = None,
              val_every: int = 100, status: str = "finished") -> dict:
    """run.json + metrics.jsonl with `steps` training lines; returns the written columns."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({
        "schema": "agoq.run/1", "model": {"spec": "synthetic", "name": "synthetic", "fingerprint": "f" * 16},
        "plan": plan, "settings": {"steps": steps, "parallel": "ddp" if ranks > 1 else "none"},
        "world": {"size": ranks}, "status": status, "started": "2026-11-21T10:00:00+00:00",
        "updated": "2026-11-21T11:00:00+00:00", "step": steps, "message": None}))
    loss = 4.0 * np.exp(-np.arange(steps) / (steps / 3)) + rng.normal(0, 0.05, steps)
    peak = rng.integers(2**20, 2**24, size=(steps, ranks))
    lines = []
    for i in range(steps):
        lines.append(json.dumps({"step": i + 1, "loss": float(loss[i]), "grad_norm": 1.0, "lr": 3e-4,
                                 "tokens_per_s": float(1000 + rng.normal(0, 10)), "step_seconds": 0.1,
                                 "peak_bytes": [int(p) for p in peak[i]], "time": 1763700000.0 + 0.1 * i}))
        if (i + 1) % val_every == 0:
            lines.append(json.dumps({"step": i + 1, "val_loss": float(loss[i] + 0.1), "time": 1763700000.0 + 0.1 * i}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return {"loss": loss, "peak": peak}
