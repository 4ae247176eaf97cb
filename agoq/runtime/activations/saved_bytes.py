"""Measure the bytes autograd actually keeps for backward, per decoder layer and tensor kind.

`track_saved_tensors(model)` installs saved-tensor hooks for one forward pass: every tensor autograd
saves is attributed to the decoder layer running at that moment and to a tensor kind, and counted
once per storage (views of one buffer count once; parameters are not activations and are skipped).
Kinds come from LAAQ's own labels, or, in unmodified layers, from the submodule that saved the tensor.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

_labels: dict[int, str] | None = None  # storage pointer -> kind, only while a tracker is active
_scopes: list[str] = []  # kinds of the code now running, innermost last


@contextlib.contextmanager
def scope(kind: str):
    """Attribute tensors saved inside this block (and not labelled otherwise) to `kind`."""
    _scopes.append(kind)
    try:
        yield
    finally:
        _scopes.pop()


def label(t: torch.Tensor, kind: str) -> None:
    """Tag a tensor about to be saved for backward with its kind (no-op unless a tracker is active)."""
    if _labels is not None:
        _labels[t.untyped_storage().data_ptr()] = kind


# unmodified layers: which submodule saved a tensor tells its kind
_SUBMODULE_KIND = {
    "input_layernorm": "norm", "post_attention_layernorm": "norm",
    "q_proj": "qkv_input", "k_proj": "qkv_input", "v_proj": "qkv_input", "self_attn": "attention",
    "o_proj": "o_proj_input", "gate_proj": "ffn1_input", "up_proj": "ffn1_input", "mlp": "silu_mul",
    "down_proj": "ffn2_input",
}


@dataclass
class SavedTensorLog:
    """Bytes kept for backward: by_layer[i][kind] in bytes, plus `outside` layers (embedding, head, loss)."""

    by_layer: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    outside: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tensors: list[tuple[int | None, str, tuple[int, ...], str, int]] = field(default_factory=list)

    def layer_total(self, layer: int) -> int:
        """Bytes kept by one decoder layer."""
        return sum(self.by_layer[layer].values())

    def total(self) -> int:
        """Bytes kept by the whole forward pass."""
        return sum(self.layer_total(i) for i in self.by_layer) + sum(self.outside.values())

    def as_dict(self) -> dict:
        return {"by_layer": {i: dict(k) for i, k in sorted(self.by_layer.items())}, "outside": dict(self.outside)}


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in order: the modules holding self_attn, mlp and two RMSNorms."""
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))]


@contextlib.contextmanager
def track_saved_tensors(model: nn.Module):
    """Context manager yielding a SavedTensorLog filled by the forward passes run inside it."""
    global _labels
    log = SavedTensorLog()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: set[int] = set()
    where: list = []  # stack of (layer index, submodule kind)
    handles = []

    def leave(module, args, output) -> None:
        where.pop()

    shared: set[int] = set()  # storages handed to layers besides the hidden state (RoPE tables, masks)

    def enter_layer(index: int):
        def hook(module, args, kwargs) -> None:
            extra = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
            for item in extra:
                for t in item if isinstance(item, (tuple, list)) else (item,):
                    if isinstance(t, torch.Tensor):
                        shared.add(t.untyped_storage().data_ptr())
            where.append((index, None))
        return hook

    for index, layer in enumerate(find_decoder_layers(model)):
        handles.append(layer.register_forward_pre_hook(enter_layer(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(leave))
        for name, sub in layer.named_modules():
            kind = _SUBMODULE_KIND.get(name.rsplit(".", 1)[-1])
            if kind is None or sub is layer:
                continue
            handles.append(sub.register_forward_pre_hook(
                lambda m, a, k=kind: where.append((where[-1][0] if where else None, k))))
            handles.append(sub.register_forward_hook(leave))

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t.detach()
        ptr = storage.data_ptr()
        if ptr in params or ptr in seen or storage.nbytes() == 0:
            return t.detach()
        seen.add(ptr)
        if ptr in shared:
            layer, sub_kind = None, "layer_inputs"
        else:
            layer, sub_kind = where[-1] if where else (None, None)
        kind = (_labels or {}).get(ptr) or (_scopes[-1] if _scopes else None) or sub_kind or "other"
        nbytes = storage.nbytes()
        if layer is None:
            log.outside[kind] += nbytes
        else:
            log.by_layer[layer][kind] += nbytes
        log.tensors.append((layer, kind, tuple(t.shape), str(t.dtype), nbytes))
        return t.detach()  # never the tensor itself: a saved output would keep its own graph alive

    _labels = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield log
    finally:
        _labels = None
        for h in handles:
            h.remove()
