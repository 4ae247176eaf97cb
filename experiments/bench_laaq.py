"""One fwd+bwd step of a LLaMA model under each activation policy: step time, memory, bytes kept.

For each variant (bf16, full per-block checkpointing, agoq-paper, int8, int4 by default):
  - step time: median of CUDA-event-timed fwd+bwd steps (grads set to None before each step);
  - memory above weights: peak allocated during the step minus allocated before the forward;
  - bytes kept for backward per layer (measured by saved-tensor hooks, per kind), vs bf16's layer;
  - weight-gradient relative L2 error vs the bf16 step on the same batch.

    python experiments/bench_laaq.py [--model probe] [--batch 2] [--seq 4096] [--variants ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import agoq  # noqa: E402
from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes  # noqa: E402
from agoq.runtime.activations.checkpointing import apply_checkpointing, remove_checkpointing  # noqa: E402
from agoq.models import build  # noqa: E402
from experiments.record import write_result  # noqa: E402

GiB = 2**30


def step(model, ids, labels):
    loss = model(ids, labels)
    loss.backward()
    return loss


def force_fused_keep(model):
    """Every layer through LAAQ's fused functions with every kind kept at 16 bits: the runtime's own
    bf16, to separate what quantizing costs from what the fused norm and SwiGLU kernels save."""
    from agoq.runtime.activations.laaq import QuantConfig, _layer_parts, _make_forward
    from agoq.runtime.activations.saved_bytes import find_decoder_layers

    settings = agoq.ActivationPolicy().settings(0)
    for layer in find_decoder_layers(model):
        layer.forward = _make_forward(layer, _layer_parts(layer), settings, QuantConfig())
        layer._agoq_settings = settings


def set_variant(model, name):
    agoq.remove_activation_policy(model)
    remove_checkpointing(model)
    if name == "checkpoint":
        apply_checkpointing(model)
    elif name == "fused-bf16":
        force_fused_keep(model)
    else:
        agoq.apply_activation_policy(model, variant_policy(name))


def variant_policy(name):
    """A preset, optionally with its format and block: "agoq-paper:nf4:64"."""
    preset_name, *rest = name.split(":")
    options = {}
    if rest:
        options["format"] = rest[0]
    if len(rest) > 1:
        options["block"] = int(rest[1])
    return agoq.preset(preset_name, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="probe")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default="bf16,checkpoint,fused-bf16,agoq-paper,agoq-paper:nf4:64,int8,int4")
    parser.add_argument("--name", default="laaq_probe")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no memory figures)")
    args = parser.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build(args.model, dtype=torch.bfloat16, device=dev, num_layers=args.layers)
    cfg = model.config
    g = torch.Generator(device=dev).manual_seed(1234)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)
    labels = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=g)
    shape = LayerShape.from_config(cfg, args.batch, args.seq, 2)
    mid = cfg.num_hidden_layers // 2

    results, ref_grads = {}, None
    for name in args.variants.split(","):
        set_variant(model, name)
        # bytes kept for backward, measured (an untimed pass)
        model.zero_grad(set_to_none=True)
        with agoq.track_saved_tensors(model) as log:
            step(model, ids, labels)
        grads = {n: p.grad.detach().float().clone() if name == "bf16" else p.grad.detach().float()
                 for n, p in model.named_parameters() if p.grad is not None}
        if name == "bf16":
            ref_grads = grads
        err = None
        if ref_grads is not None and name != "bf16":
            num = sum(((grads[n] - ref_grads[n]) ** 2).sum().item() for n in ref_grads)
            den = sum((ref_grads[n] ** 2).sum().item() for n in ref_grads)
            err = (num / den) ** 0.5
        del grads
        # timing and memory
        times, peaks = [], []
        for i in range(args.warmup + args.steps):
            model.zero_grad(set_to_none=True)
            if not cuda:
                t0 = time.perf_counter()
                step(model, ids, labels)
                times.append((time.perf_counter() - t0) * 1e3)
                peaks.append(0)
                continue
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(model, ids, labels)
            end.record()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(start.elapsed_time(end))
                peaks.append(torch.cuda.max_memory_allocated() - before)
        policy = None if name in ("checkpoint", "fused-bf16") else variant_policy(name)
        predicted = None
        if policy is not None:
            predicted = predict_layer_bytes(shape, None if policy.keeps_everything(mid) else policy.settings(mid),
                                            policy.block)
        row = {
            "step_ms": statistics.median(times), "step_ms_all": times,
            "memory_above_weights_GiB": max(peaks) / GiB,
            "layer_saved_bytes": log.layer_total(mid), "layer_saved_by_kind": dict(log.by_layer[mid]),
            "layer_predicted_bytes": sum(predicted.values()) if predicted else None,
            "saved_total_GiB": log.total() / GiB, "saved_outside_layers": dict(log.outside),
            "grad_rel_l2_vs_bf16": err,
        }
        results[name] = row
        print(f"{name:11s} step {row['step_ms']:7.1f} ms  mem above weights {row['memory_above_weights_GiB']:6.2f} GiB  "
              f"layer kept {row['layer_saved_bytes'] / 2**20:7.1f} MiB  grad err {err}", flush=True)
    base = results.get("bf16")
    if base:
        for name, row in results.items():
            row["step_vs_bf16"] = row["step_ms"] / base["step_ms"]
            row["layer_saved_vs_bf16"] = row["layer_saved_bytes"] / base["layer_saved_bytes"]
            if base["memory_above_weights_GiB"]:
                row["memory_vs_bf16"] = row["memory_above_weights_GiB"] / base["memory_above_weights_GiB"]
    print(f"\n{'variant':11s} {'step ms':>8s} {'x bf16':>7s} {'mem GiB':>8s} {'layer kept':>11s} {'vs bf16':>8s} {'pred/meas':>9s}")
    for name, row in results.items():
        pm = (row["layer_predicted_bytes"] / row["layer_saved_bytes"]) if row["layer_predicted_bytes"] else float("nan")
        print(f"{name:11s} {row['step_ms']:8.1f} {row.get('step_vs_bf16', 0):7.3f} {row['memory_above_weights_GiB']:8.2f} "
              f"{row['layer_saved_bytes'] / 2**20:9.1f}MiB {row.get('layer_saved_vs_bf16', 0):8.3f} {pm:9.4f}")
        print("    per kind (MiB):", {k: round(v / 2**20, 1) for k, v in row["layer_saved_by_kind"].items()})
    unit = args.batch * args.seq * cfg.hidden_size * 2
    figures = {"model": args.model, "layers": cfg.num_hidden_layers, "batch": args.batch, "seq": args.seq,
               "U_bytes": unit, "measured_layer": mid, "variants": results}
    print("wrote", write_result(args.name, figures, args.out))


if __name__ == "__main__":
    main()
