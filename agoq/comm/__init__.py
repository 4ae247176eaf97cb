"""Communication: gradients and weights sent in few bits between ranks.

QuanGrad (`quangrad`): gradients stored and all-reduced in 8 bits (`quantized_all_reduce`, over NCCL
collectives or symmetric memory, `wire_rows` / `wire_triton` for the on-wire rows). SDP4Bit (`sdp4bit`):
TLq-HS gradient reduce-scatter (Hadamard + int8 inside a node, int4 across) and qWD weight-difference
all-gather; `fsdp_collectives` runs TLq-HS as PyTorch FSDP2's custom reduce-scatter and `fsdp` shards a
model with FSDP2 and it. A new collective goes here.
"""

from agoq.comm.quangrad import QuantizedGradients, quangrad_hook
from agoq.comm.quantized_allreduce import quantized_all_reduce
from agoq.comm.sdp4bit import qwd_all_gather, tlq_hs_reduce_scatter

__all__ = ["QuantizedGradients", "quangrad_hook", "quantized_all_reduce", "qwd_all_gather", "tlq_hs_reduce_scatter"]
