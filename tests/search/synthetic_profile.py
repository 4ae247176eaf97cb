"""Write a Profile folder in the documented format (docs/formats.md) with bytes from the runtime's byte
predictor and random sensitivities and times, for testing the search without running the profiler."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd

from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.runtime.activations.policy import KINDS, RECOMPUTABLE, split_layers
from agoq.models import build, fingerprint

BITS = (8, 6, 5, 4, 3, 2)


def kind_bytes(shape: LayerShape, kind: str, setting, block: int) -> int:
    settings = {k: 8 for k in KINDS}
    settings[kind] = setting
    return predict_layer_bytes(shape, settings, block)[kind]


def synthetic_steps(rng: random.Random, num_layers: int, micro_batch: int, step_seconds: float,
                    compile_modes=("eager",), peak: int | None = None) -> list[dict]:
    """Measured steps as the profiler records them (agoq.formats.measured_steps), from a random linear time model:
    one micro-batch of m sequences costs fb(m) = a + b m (fb(profiled) + the optimizer step = `step_seconds` for
    bf16), each further micro-batch of a step the same plus an accumulation cost; a layer under LAAQ or
    checkpointed adds its own seconds per micro-batch; QuanGrad, another optimizer or masters add their own. At
    every micro-batch m dividing the profiled one: steps of one and of two micro-batches (as the profiler measures
    them). Peaks: `peak` for every step (None: not measured)."""
    optimizer = step_seconds * rng.uniform(0.05, 0.15)
    fb0 = step_seconds - optimizer
    a = fb0 * rng.uniform(0.05, 0.3)
    b = (fb0 - a) / micro_batch
    accumulate = fb0 * rng.uniform(0.0, 0.05)
    quangrad = fb0 * rng.uniform(0.0, 0.05)
    policy_cost = {"bf16": 0.0, "agoq-paper": rng.uniform(0.0, 0.1) * fb0 / num_layers,
                   "checkpoint-all": rng.uniform(0.2, 0.4) * fb0 / num_layers}
    others = {("adamw", "fp32"): optimizer * rng.uniform(1.2, 2.0), ("adamw8bit", "none"): optimizer * rng.uniform(0.6, 1.0)}
    rows = []

    def add(compile_mode, policy, m, accum, gradients="bf16", opt=("adamw8bit", "fp32"), extra=0.0):
        per = a + b * m + num_layers * policy_cost[policy] * (m / micro_batch + 0.5) / 1.5
        seconds = accum * per + (accum - 1) * accumulate + optimizer + extra
        rows.append({"compile": compile_mode, "policy": policy, "activation_memory_budget": None, "micro_batch": m,
                     "grad_accum": accum, "gradients": gradients, "optimizer": opt[0], "master": opt[1],
                     "steps": 5, "step_seconds": seconds, "peak_bytes": peak, "first_step_peak_bytes": peak,
                     "source": "profile"})

    for compile_mode in compile_modes:
        scale = 1.0 if compile_mode == "eager" else 0.8
        for m in [d for d in range(1, micro_batch + 1) if micro_batch % d == 0]:
            for accum in (1, 2):
                for policy in policy_cost:
                    add(compile_mode, policy, m, accum)
                add(compile_mode, "bf16", m, accum, "quangrad8", extra=quangrad * accum)
        for opt, seconds in others.items():
            add(compile_mode, "bf16", micro_batch, 1, opt=opt, extra=seconds - optimizer)
        for row in rows:
            if row["compile"] == compile_mode:
                row["step_seconds"] *= scale
    return rows


def write_profile(folder, rng: random.Random, model: str = "llama-tiny", num_layers: int | None = None,
                  micro_batch: int = 2, seq_len: int = 48, block: int = 128, stages: int = 1,
                  in_flight: list[int] | None = None, world_size: int = 1, collectives: bool = False,
                  bits=BITS, step_seconds: float | None = 0.05, layer_forward: bool = False,
                  optimizer_step_bytes: int | None = None, laaq_transient: int | None = None,
                  fsdp_collectives: bool = False, link_bytes_per_second: float = 1e10,
                  compile_modes: tuple = ("eager",), step_peaks: bool = False, host_link: dict | None = None) -> Path:
    """A profile of `model` at micro-batch x seq_len tokens; returns the folder. `collectives`: all-reduce
    timings of nccl-bf16, quangrad8 and sdp4bit, factor x message bytes / `link_bytes_per_second` seconds;
    `fsdp_collectives` adds the all-gather (nccl-bf16) and reduce-scatter (nccl-bf16, sdp4bit) FSDP2 needs.
    With `step_seconds`, the measured steps the search prices from (`synthetic_steps`) in each of `compile_modes`,
    with peaks when `step_peaks`. `host_link`: the profile's timing.host_link (agoq.profiler.host_link)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    m = build(model, device="meta", num_layers=num_layers)
    cfg = m.config
    L = cfg.num_hidden_layers
    shape = LayerShape.from_config(cfg, micro_batch, seq_len, 2)
    rows = []
    for layer in range(L):
        for kind in KINDS:
            base_err = rng.uniform(0.001, 0.2) * (3.0 if kind == "attention" else 1.0)
            options = [("16", 16, "bf16")] + [(str(b), b, "int") for b in bits]
            if kind in RECOMPUTABLE:
                options.append(("recompute", 0, "recompute"))
            for option, b, fmt in options:
                setting = "recompute" if option == "recompute" else b
                nbytes = kind_bytes(shape, kind, setting, block)
                if option == "16":
                    sens, extra = 0.0, 0.0
                elif option == "recompute":  # exact; a GPU profile reads the floor of two reruns
                    sens, extra = rng.uniform(0.0, 0.01), rng.uniform(1e-4, 1e-3)
                else:
                    sens = base_err * 2.0 ** (4 - b) * rng.uniform(0.8, 1.2)
                    extra = rng.uniform(1e-5, 1e-4)
                shared = 0 if (kind, option) == ("o_proj_input", "16") else nbytes  # attention at 16 keeps it
                rows.append({"layer": layer, "kind": kind, "option": option, "bits": b, "format": fmt,
                             "shape": f"{micro_batch}x{seq_len}x{cfg.hidden_size}", "bytes": shared,
                             "bytes_unshared": nbytes,
                             "quant_error": 0.0 if b in (0, 16) else sens / 2, "sqnr_db": float("inf"),
                             "sensitivity": sens, "extra_seconds": extra,
                             "quantize_seconds": float("nan"), "dequantize_seconds": float("nan"),
                             "recompute_seconds": extra if option == "recompute" else float("nan")})
    pd.DataFrame(rows).to_parquet(folder / "profile.parquet")
    params = sum(p.numel() for p in m.parameters())
    layer_stage = split_layers(L, stages)
    if in_flight is None:
        in_flight = [stages - s for s in range(stages)]
    header = {
        "schema": "agoq.profile/1",
        "model": {"spec": model, "name": cfg.name, "fingerprint": fingerprint(m), "config": cfg.to_dict(),
                  "num_layers": L, "parameters": params, "weight_bytes": 2 * params},
        "settings": {"seq_len": seq_len, "micro_batch": micro_batch, "dtype": "bf16", "device": "cpu",
                     "bits": list(bits), "formats": ["int"], "block": block, "batches": 2, "seed": 0,
                     "pipeline_stages": stages, "micro_batches": max(in_flight), "world_size": world_size,
                     "budget_bytes": None},
        "hardware": {"device": "cpu", "name": "test", "memory_bytes": None, "count": 1, "cpu_count": 2},
        "software": {"agoq": "0.1.0"},
        "date": "2026-11-21T00:00:00+00:00",
        "memory": {"weights_bytes": 2 * params, "gradients_bytes_bf16": 2 * params,
                   "gradients_bytes_quangrad8": params + 4 * (params // 256 + 1),
                   "optimizer_bytes_adamw": 8 * params, "optimizer_bytes_adamw8bit": 2 * params,
                   "measured_with": {"optimizer": "adamw8bit", "master": "fp32", "gradients": "bf16"},
                   "fixed_bytes": rng.randrange(10**5, 10**6), "outside_activation_bytes": rng.randrange(10**4, 10**5),
                   "steps": [] if step_seconds is None else [{"policy": "bf16", "measured_peak_bytes": None,
                                                             "predicted_peak_bytes": None,
                                                             "step_seconds": step_seconds}]},
        "pipeline": {"stages": stages, "micro_batches": max(in_flight), "layer_stage": layer_stage,
                     "in_flight": {"1f1b": in_flight}},
        "failures": [],
    }
    if step_seconds is not None:
        header["measured_steps"] = {"version": 1, "rows": synthetic_steps(
            rng, L, micro_batch, step_seconds, compile_modes, peak=rng.randrange(10**6, 10**7) if step_peaks else None)}
    if laaq_transient is not None:  # the agoq-paper step peaked this much above its prediction
        predicted = rng.randrange(10**6, 10**7)
        header["memory"]["steps"].append({"policy": "agoq-paper", "predicted_peak_bytes_forward_backward": predicted,
                                          "measured_peak_bytes_forward_backward": predicted + laaq_transient})
    if optimizer_step_bytes is not None:
        header["memory"]["fixed_bytes_optimizer_step"] = optimizer_step_bytes
    if layer_forward:
        header["timing"] = {"layer_forward_seconds": [rng.uniform(1e-3, 2e-3) for _ in range(L)]}
    if host_link is not None:
        header.setdefault("timing", {})["host_link"] = host_link
    (folder / "profile.json").write_text(json.dumps(header, indent=2))
    if collectives:
        coll = []
        for path, factor in (("nccl-bf16", 1.0), ("quangrad8", 0.4), ("sdp4bit", 0.3)):
            for size in (2**20, 2**24, 2**28):
                coll.append({"op": "all_reduce", "path": path, "world_size": world_size, "message_bytes": size,
                             "seconds": factor * size / link_bytes_per_second})
        if fsdp_collectives:  # a ring's reduce-scatter and all-gather each move about half an all-reduce's bytes
            for op, path, factor in (("all_gather", "nccl-bf16", 0.5), ("reduce_scatter", "nccl-bf16", 0.5),
                                     ("reduce_scatter", "sdp4bit", 0.2)):
                for size in (2**16, 2**20, 2**24, 2**28):
                    coll.append({"op": op, "path": path, "world_size": world_size, "message_bytes": size,
                                 "seconds": factor * size / link_bytes_per_second + 2e-5})
        pd.DataFrame(coll).to_parquet(folder / "collectives.parquet")
    return folder


def add_offload_rows(folder, layers: int, delta, offload_modes=("eager", "compiled"), accums=(1, 2),
                     offloaded_bytes: int = 0) -> None:
    """Add to a written profile what `agoq profile` measures where it measured a host link: beside each kept
    agoq-paper step of `offload_modes` and `accums`, the same step with layers 0..layers-2 offloaded, `delta(row)`
    seconds longer."""
    header = json.loads((Path(folder) / "profile.json").read_text())
    rows = header["measured_steps"]["rows"]
    added = [{**r, "offload_layers": layers - 1, "offloaded_bytes": offloaded_bytes,
              "step_seconds": r["step_seconds"] + delta(r)}
             for r in rows if r["policy"] == "agoq-paper" and r["grad_accum"] in accums and r["compile"] in offload_modes]
    header["measured_steps"] = {"version": 2, "rows": rows + added}
    (Path(folder) / "profile.json").write_text(json.dumps(header))
