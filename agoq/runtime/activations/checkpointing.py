"""Activation checkpointing of whole decoder layers: the baseline that LAAQ competes with.

Each chosen layer keeps only its input for backward and runs its forward again there.
"""

from __future__ import annotations

import types

from torch import nn
from torch.utils.checkpoint import checkpoint

from agoq.runtime.activations.saved_bytes import find_decoder_layers


def apply_checkpointing(model: nn.Module, layers: list[int] | None = None) -> list[int]:
    """Checkpoint the given decoder layers (default: all); returns the indices checkpointed."""
    found = find_decoder_layers(model)
    chosen = list(range(len(found))) if layers is None else sorted(set(layers))
    bad = [i for i in chosen if not 0 <= i < len(found)]
    if bad:
        raise ValueError(f"layer indices {bad} out of range: the model has {len(found)} decoder layers")
    for i in chosen:
        layer = found[i]
        inner = layer.forward

        def forward(self, *args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = types.MethodType(forward, layer)
        layer._agoq_checkpointed = True
    return chosen


def remove_checkpointing(model: nn.Module) -> None:
    """Undo `apply_checkpointing`."""
    for layer in find_decoder_layers(model):
        if getattr(layer, "_agoq_checkpointed", False):
            del layer.forward
            layer._agoq_checkpointed = False
