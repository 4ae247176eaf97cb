"""Optimizer state: float32 master weights, AdamW with 8-bit moments, and SDP4Bit's sharded AdamW.
A new optimizer goes here."""

from agoq.optim.adamw8bit import AdamW8bit, FusedAdamW8bit
from agoq.optim.fused_adamw import grad_norm_sq
from agoq.optim.master_weights import MasterWeights
from agoq.optim.sdp4bit import SDP4BitOptimizer

__all__ = ["AdamW8bit", "FusedAdamW8bit", "grad_norm_sq", "MasterWeights", "SDP4BitOptimizer"]
