"""Make a model: ``build`` a freshly initialised ``LlamaForCausalLM`` from a spec, and ``fingerprint`` its
architecture. Imports torch (agoq.models itself does not: its names load on first use)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from agoq.models.config import ModelSpec, resolve_config
from agoq.models.llama import LlamaForCausalLM


def build(spec: ModelSpec, *, dtype: torch.dtype | None = None,
          device: torch.device | str | None = None, seed: int = 0,
          num_layers: int | None = None) -> nn.Module:
    """Build a freshly initialised ``LlamaForCausalLM`` from a model spec (see ``resolve_config``).

    The weights are drawn after ``torch.manual_seed(seed)`` (this reseeds the global RNG),
    so the same seed and device give the same model. Parameters are created directly on
    ``device`` (``"meta"`` allocates nothing), in float32, then cast to ``dtype`` if given,
    so a bfloat16 model holds the rounded weights of the float32 one. ``num_layers``
    replaces ``num_hidden_layers``, e.g. to profile a few layers of a large model.
    """
    config = resolve_config(spec)
    if num_layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=num_layers)
    torch.manual_seed(seed)
    if device is None:
        model = LlamaForCausalLM(config)
    else:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def fingerprint(model: nn.Module) -> str:
    """A 16-hex-digit identity of a model's architecture: a SHA-256 over its parameters' names and shapes.

    Dtype, device and weight values do not enter, so a bf16 model on the GPU and the fp32 one on the
    CPU share a fingerprint; another layer count, width or vocabulary does not. Profiles, plans and
    runs carry it so a plan made for one model is refused by another.
    """
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:16]


__all__ = ["build", "fingerprint"]
