"""Communication: gradients and weights sent in few bits between ranks.

QuanGrad (`quangrad`): gradients stored and all-reduced in 8 bits (`quantized_all_reduce`, over NCCL
collectives or symmetric memory, `wire_rows` / `wire_triton` for the on-wire rows). SDP4Bit (`sdp4bit`):
TLq-HS gradient reduce-scatter (Hadamard + int8 inside a node, int4 across) and qWD weight-difference
all-gather; `fsdp_collectives` runs TLq-HS as PyTorch FSDP2's custom reduce-scatter and `fsdp` shards a
model with FSDP2 and it. A new collective goes here.
"""

import importlib

_HOMES = {  # public name -> the module that defines it
    "QuantizedGradients": "agoq.comm.quangrad",
    "quangrad_hook": "agoq.comm.quangrad",
    "quantized_all_reduce": "agoq.comm.quantized_allreduce",
    "qwd_all_gather": "agoq.comm.sdp4bit",
    "tlq_hs_reduce_scatter": "agoq.comm.sdp4bit",
}

__all__ = list(_HOMES)


def __getattr__(name: str):  # PEP 562: a public name loads its home module on first use, so that importing a
    home = _HOMES.get(name)  # light submodule (e.g. agoq.comm.lanes) does not load the kernels
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
