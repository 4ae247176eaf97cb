"""Activation checkpointing of whole decoder layers: the baseline that LAAQ competes with.

Each chosen layer keeps only its input for backward and runs its forward again there.

torch's checkpoint saves and restores the random number generators' state around the rerun by default, so that a
layer drawing random numbers (dropout) draws the same ones again. agoq's own decoder layer (agoq.models.llama,
`draws_random_numbers = False`) draws none: its layers are checkpointed without that (`preserve_rng_state=False`),
the same values either way, and under torch.compile the rerun then holds no RNG-state operator, which kept
inductor's graph cache from storing the layer ("Can't cache HigherOrderOperator: graphsafe_run_with_rng_state",
`experiments/results/compile_cache_probe_*.json`): each new model compiled the layer again. Other models' layers
keep torch's default.
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
        preserve = not _draws_no_random_numbers(layer)

        def forward(self, *args, _inner=inner, _preserve=preserve, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=_preserve, **kwargs)

        layer.forward = types.MethodType(forward, layer)
        layer._agoq_checkpointed = True
    return chosen


def _draws_no_random_numbers(layer: nn.Module) -> bool:
    """Whether the layer's class says its forward draws no random numbers (`draws_random_numbers = False`, as
    agoq.models.llama's decoder layer does); a layer that says nothing is taken to draw some."""
    return getattr(type(layer), "draws_random_numbers", True) is False


def remove_checkpointing(model: nn.Module) -> None:
    """Undo `apply_checkpointing`."""
    for layer in find_decoder_layers(model):
        if getattr(layer, "_agoq_checkpointed", False):
            del layer.forward
            layer._agoq_checkpointed = False
