"""Reference models, and ``build`` to make one from a preset, a config.json, a dict or a config."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Union

import torch
from torch import nn

from agoq.files import read_json_object

from .llama import PRESETS, LlamaConfig, LlamaForCausalLM

ModelSpec = Union[str, os.PathLike, dict, LlamaConfig]


def _load_json_config(path: Path) -> LlamaConfig:
    d = read_json_object(path, "model config file")
    if "name" not in d:
        # HF checkpoints keep config.json in a folder named after the model
        d = {**d, "name": path.parent.name if path.name == "config.json" and path.parent.name else path.stem}
    return LlamaConfig.from_dict(d)


def resolve_config(spec: ModelSpec) -> LlamaConfig:
    """Turn a model spec into a ``LlamaConfig`` (a new object; presets are not shared).

    ``spec`` is a preset name (a key of ``PRESETS``), a path to a HuggingFace-style
    ``config.json`` (str ending in .json, an existing file, or a ``PathLike``), a dict
    of HF or ``LlamaConfig`` fields, or a ``LlamaConfig``.
    """
    if isinstance(spec, LlamaConfig):
        return dataclasses.replace(spec)
    if isinstance(spec, dict):
        return LlamaConfig.from_dict(spec)
    if isinstance(spec, os.PathLike):
        return _load_json_config(Path(spec))
    if isinstance(spec, str):
        if spec in PRESETS:
            return dataclasses.replace(PRESETS[spec])
        if spec.endswith(".json") or os.path.isfile(spec):
            return _load_json_config(Path(spec))
        raise ValueError(
            f"unknown model {spec!r}: give one of the presets {', '.join(sorted(PRESETS))}, "
            f"or a path to a HuggingFace config.json")
    raise TypeError(
        f"model spec must be a preset name, a config.json path, a dict or a LlamaConfig, "
        f"got {type(spec).__name__}")


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


__all__ = ["PRESETS", "LlamaConfig", "LlamaForCausalLM", "resolve_config", "build", "ModelSpec"]


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
