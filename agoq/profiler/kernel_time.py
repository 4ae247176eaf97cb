"""Time of the kernels an option adds to a step: quantize + dequantize, or the recompute in backward.

Times are for the tensors of one layer's kind at the profiled shapes, on the profiled device (CUDA
events on a GPU, a host clock on the CPU), median of `repeats` runs after a warm-up. All layers of
a model share shapes, so each (kind, option) is timed once.
"""

from __future__ import annotations

import statistics
import time

import torch

from agoq.runtime.activations.rmsnorm import rms_norm
from agoq.runtime.activations.swiglu import swiglu
from agoq.profiler.options import Option
from agoq.runtime.quant.codec import dequantize, quantize


def median_seconds(fn, device: torch.device, repeats: int = 5, warmup: int | None = None, before=None) -> float:
    """Median wall seconds of fn() on `device` (synchronised on CUDA), after `warmup` runs (default: 1 on
    CUDA, where the first call compiles kernels, 0 on the CPU); `before()`, untimed, precedes every run."""
    cuda = device.type == "cuda"
    if warmup is None:
        warmup = 1 if cuda else 0
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def quantize_times(shapes: list[tuple[int, ...]], option: Option, block: int, dtype: torch.dtype,
                   device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """(quantize seconds, dequantize seconds) for all tensors of `shapes` under `option`."""
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype) for s in shapes]
    qs = [quantize(t, option.bits, block, "nearest", option.format, check_finite=False) for t in tensors]
    q_time = median_seconds(lambda: [quantize(t, option.bits, block, "nearest", option.format,
                                              check_finite=False) for t in tensors], device, repeats)
    d_time = median_seconds(lambda: [dequantize(q) for q in qs], device, repeats)
    return q_time, d_time


def recompute_time(kind: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                   repeats: int = 5) -> float:
    """Seconds to rebuild a recomputable kind in backward: the RMSNorm output (qkv_input, ffn1_input)
    from its input, or SiLU(gate) * up (ffn2_input) from gate and up."""
    gen = torch.Generator(device=device).manual_seed(0)
    if kind in ("qkv_input", "ffn1_input"):
        x = torch.randn(shapes[0], generator=gen, device=device, dtype=torch.float32).to(dtype)
        w = torch.ones(shapes[0][-1], device=device, dtype=dtype)
        return median_seconds(lambda: rms_norm(x, w, 1e-5), device, repeats)
    if kind == "ffn2_input":
        gate = torch.randn(shapes[0], generator=gen, device=device, dtype=torch.float32).to(dtype)
        up = torch.randn(shapes[0], generator=gen, device=device, dtype=torch.float32).to(dtype)
        return median_seconds(lambda: swiglu(gate, up), device, repeats)
    raise ValueError(f"{kind} cannot be recomputed")


def attention_rerun_time(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                         repeats: int = 5) -> float:
    """Seconds of the causal attention forward that LAAQ reruns in backward when q, k, v are kept
    quantized (`shapes`: q [B, H, S, D], k and v [B, Hkv, S, D])."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype) for s in shapes)
    kwargs = {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    return median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs), device, repeats)


def layer_forward_seconds(model, ids: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of each decoder layer's forward (unmodified, gradients on, as whole-layer checkpointing
    reruns it in backward), median over `repeats` forwards of the model on token ids [B, S+1]."""
    from agoq.runtime.activations.saved_bytes import find_decoder_layers
    from agoq.profiler.model_source import next_token_loss

    layers = find_decoder_layers(model)
    cuda = ids.device.type == "cuda"
    starts: dict[int, float] = {}
    times: list[list[float]] = [[] for _ in layers]
    handles = []

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(ids.device)
        return time.perf_counter()

    def enter(i: int):
        def hook(module, args) -> None:
            starts[i] = now()
        return hook

    def leave(i: int):
        def hook(module, args, output) -> None:
            times[i].append(now() - starts[i])
        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(i)))
        handles.append(layer.register_forward_hook(leave(i)))
    try:
        with torch.enable_grad():
            for r in range(repeats + 1):  # the first forward warms up and is not counted
                next_token_loss(model, ids)
                if r == 0:
                    for t in times:
                        t.clear()
    finally:
        for h in handles:
            h.remove()
    return [statistics.median(t) for t in times]
