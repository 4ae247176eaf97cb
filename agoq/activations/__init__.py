"""Activation compression (LAAQ): what each decoder layer keeps for backward, and how.

An `ActivationPolicy` says per layer and tensor kind whether a tensor is kept as is, block-quantized to
2..8 bits or recomputed; `apply_activation_policy` swaps the model's layers for fused ones (RMSNorm and
SwiGLU kernels beside their references) that save what the policy says; `checkpointing` reruns whole
layers; `saved_bytes` measures what autograd really keeps.
"""

from agoq.activations.laaq import apply_activation_policy, remove_activation_policy
from agoq.activations.policy import (
           KINDS,
           ActivationPolicy,
           preset,
           stage_aware_policy,
           stage_bits,
)
from agoq.activations.saved_bytes import track_saved_tensors

__all__ = ["apply_activation_policy", "remove_activation_policy", "ActivationPolicy", "KINDS", "preset",
           "stage_aware_policy", "stage_bits", "track_saved_tensors"]
