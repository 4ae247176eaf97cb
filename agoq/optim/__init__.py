"""Optimizer state: float32 master weights, AdamW with 8-bit moments, and SDP4Bit's sharded AdamW.
A new optimizer goes here."""

import importlib

_HOMES = {  # public name -> the module that defines it
    "AdamW8bit": "agoq.optim.adamw8bit",
    "FusedAdamW8bit": "agoq.optim.adamw8bit",
    "grad_norm_sq": "agoq.optim.fused_adamw",
    "MasterWeights": "agoq.optim.master_weights",
    "SDP4BitOptimizer": "agoq.optim.sdp4bit",
}

__all__ = list(_HOMES)


def __getattr__(name: str):  # PEP 562: a public name loads its home module on first use, so that importing a
    home = _HOMES.get(name)  # light submodule (e.g. agoq.optim.state_bytes) does not load the kernels
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
