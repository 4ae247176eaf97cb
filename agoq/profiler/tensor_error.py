"""Quantization error of the tensors a model really keeps, per decoder layer, kind and option.

One forward pass per batch runs with every kind routed through LAAQ's stash (the `int8` policy; the
forward values do not depend on the policy), and `observe_kept_tensors` hands each tensor to us
before it is quantized: exactly the tensors the runtime would store. Each is quantized and
dequantized with every option; squared errors and squared norms are summed per (layer, kind, option)
over all its tensors and batches, so the reported error is ||x' - x|| / ||x|| over the lot. The sums stay on the
device until the end (one read, not one synchronisation per tensor and option); on one H200 the probe's phase took
13.5 s with a read each, 10.3 and 11.7 s without (`experiments/results/profile_time_*.json`,
`plan_accuracy_probe_profile_fast.json`): the reads were not most of it.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn

from agoq.runtime.activations.laaq import (
    apply_activation_policy,
    observe_kept_tensors,
    remove_activation_policy,
)
from agoq.runtime.activations.saved_bytes import find_decoder_layers
from agoq.profiler.model_source import next_token_loss
from agoq.profiler.options import Option
from agoq.runtime.quant.codec import dequantize, quantize


def squared_error(x: torch.Tensor, option: Option, block: int, x64: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of squared quantization errors of x under `option`, in float64, as a 0-d tensor on x's device (no
    synchronisation: `measure_tensor_errors` reads all of them once) (`x64`: x.double(), if at hand)."""
    q = quantize(x, option.bits, block, "nearest", option.format, check_finite=False)
    x64 = x.double() if x64 is None else x64
    return (dequantize(q).double() - x64).pow(2).sum()


def sqnr_db(rel_error: float) -> float:
    """Signal-to-quantization-noise ratio in dB from a relative L2 error (inf for 0)."""
    return math.inf if rel_error == 0 else -20.0 * math.log10(rel_error)


def measure_tensor_errors(model: nn.Module, batches: list[torch.Tensor], options: dict[str, list[Option]],
                          block: int) -> dict[tuple[int, str, str, str], float]:
    """Relative L2 error per (layer, kind, option, format) over `batches` (token ids [B, S+1]).

    `options[kind]` lists the options to measure (non-quantized ones are skipped).
    """
    sums: dict[tuple, list] = defaultdict(lambda: [0.0, 0.0])  # float64 0-d tensors once added to
    layer_now: list[int] = []
    handles = []

    def leave(module, args, output) -> None:
        layer_now.pop()

    for index, layer in enumerate(find_decoder_layers(model)):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=index: layer_now.append(i)))
        handles.append(layer.register_forward_hook(leave))

    def observe(kind: str, t: torch.Tensor, setting) -> None:
        if not layer_now:
            return
        quantized = [o for o in options.get(kind, []) if o.quantized]
        if not quantized:
            return
        x = t.detach()
        x64 = x.double()
        norm = x64.pow(2).sum()
        for option in quantized:
            acc = sums[(layer_now[-1], kind, option.option, option.format)]
            acc[0] = acc[0] + squared_error(x, option, block, x64)
            acc[1] = acc[1] + norm

    apply_activation_policy(model, "int8")
    try:
        with observe_kept_tensors(observe), torch.enable_grad():
            for ids in batches:
                next_token_loss(model, ids)  # forward only: the graph is dropped
    finally:
        remove_activation_policy(model)
        for h in handles:
            h.remove()
    keys = list(sums)  # every sum read back in one transfer
    values = torch.stack([torch.stack(sums[k]) for k in keys]).cpu().tolist() if keys else []
    return {key: (e / n) ** 0.5 if n > 0 else 0.0 for key, (e, n) in zip(keys, values)}
