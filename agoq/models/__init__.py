"""Reference models, and ``build`` to make one from a preset, a config.json, a dict or a config.

The names below load on first use (PEP 562): the configs (agoq.models.config) and the memory models beside them
(size_check, step_peak) import no torch, so the search reads a model's shapes without it; ``build``,
``fingerprint`` and ``LlamaForCausalLM`` import torch when first read.
"""

from __future__ import annotations

from agoq.lazy import lazy_exports

# public name -> the module that defines it
_HOMES = {
    "PRESETS": "agoq.models.config", "LlamaConfig": "agoq.models.config", "ModelSpec": "agoq.models.config",
    "resolve_config": "agoq.models.config",
    "LlamaForCausalLM": "agoq.models.llama",
    "build": "agoq.models.factory", "fingerprint": "agoq.models.factory",
}

__all__ = ["PRESETS", "LlamaConfig", "LlamaForCausalLM", "resolve_config", "build", "ModelSpec"]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)  # each name loads its home on first use
