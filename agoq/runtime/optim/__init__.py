"""Optimizer state: float32 master weights and AdamW with 8-bit moments.
A new optimizer goes here."""

from agoq.lazy import lazy_exports

_HOMES = {  # public name -> the module that defines it
    "AdamW8bit": "agoq.runtime.optim.adamw8bit",
    "FusedAdamW8bit": "agoq.runtime.optim.adamw8bit",
    "grad_norm_sq": "agoq.runtime.optim.fused_adamw",
    "MasterWeights": "agoq.runtime.optim.master_weights",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)  # each name loads its home on first use
