"""Activation compression (LAAQ): what each decoder layer keeps for backward, and how.

An `ActivationPolicy` says per layer and tensor kind whether a tensor is kept as is, block-quantized to
2..8 bits or recomputed; `apply_activation_policy` swaps the model's layers for fused ones (RMSNorm and
SwiGLU kernels beside their references) that save what the policy says; `checkpointing` reruns whole
layers; `saved_bytes` measures what autograd really keeps.
"""

from agoq.lazy import lazy_exports

_HOMES = {  # public name -> the module that defines it
    "apply_activation_policy": "agoq.runtime.activations.laaq", "remove_activation_policy": "agoq.runtime.activations.laaq",
    "KINDS": "agoq.runtime.activations.policy", "ActivationPolicy": "agoq.runtime.activations.policy",
    "preset": "agoq.runtime.activations.policy", "stage_aware_policy": "agoq.runtime.activations.policy",
    "stage_bits": "agoq.runtime.activations.policy", "track_saved_tensors": "agoq.runtime.activations.saved_bytes",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)  # each name loads its home on first use
