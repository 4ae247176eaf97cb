"""Communication: gradients and weights sent in few bits between ranks.

QuanGrad (`quangrad`): gradients stored and all-reduced in 8 bits (`quantized_all_reduce`, over NCCL
collectives or symmetric memory, `wire_rows` / `wire_triton` for the on-wire rows). SDP4Bit (`sdp4bit`):
TLq-HS gradient reduce-scatter (Hadamard + int8 inside a node, int4 across) and qWD weight-difference
all-gather; `fsdp_collectives` runs TLq-HS as PyTorch FSDP2's custom reduce-scatter, `fsdp_weight_gather` makes
FSDP2's weight all-gather int8 / int4 block codes (ZeRO++'s qwZ), `hsdp` all-reduces HSDP's replicas (FSDP2's
own, QuanGrad's 8 bits or TLq's 4 bits) and `fsdp` shards a model with FSDP2 and them.
A new collective goes here.
"""

from agoq.lazy import lazy_exports

_HOMES = {  # public name -> the module that defines it
    "QuantizedGradients": "agoq.runtime.comm.quangrad",
    "quangrad_hook": "agoq.runtime.comm.quangrad",
    "quantized_all_reduce": "agoq.runtime.comm.quantized_allreduce",
    "qwd_all_gather": "agoq.runtime.comm.sdp4bit",
    "tlq_hs_reduce_scatter": "agoq.runtime.comm.sdp4bit",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)  # each name loads its home on first use
