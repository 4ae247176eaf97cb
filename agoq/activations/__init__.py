"""Activation compression (LAAQ): what each decoder layer keeps for backward, and how.

An `ActivationPolicy` says per layer and tensor kind whether a tensor is kept as is, block-quantized to
2..8 bits or recomputed; `apply_activation_policy` swaps the model's layers for fused ones (RMSNorm and
SwiGLU kernels beside their references) that save what the policy says; `checkpointing` reruns whole
layers; `saved_bytes` measures what autograd really keeps.
"""

import importlib

_HOMES = {  # public name -> the module that defines it
    "apply_activation_policy": "agoq.activations.laaq", "remove_activation_policy": "agoq.activations.laaq",
    "KINDS": "agoq.activations.policy", "ActivationPolicy": "agoq.activations.policy",
    "preset": "agoq.activations.policy", "stage_aware_policy": "agoq.activations.policy",
    "stage_bits": "agoq.activations.policy", "track_saved_tensors": "agoq.activations.saved_bytes",
}

__all__ = list(_HOMES)


def __getattr__(name: str):  # PEP 562: a public name loads its home module on first use, so that importing a
    home = _HOMES.get(name)  # light submodule (e.g. agoq.activations.policy) does not load the kernels
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
