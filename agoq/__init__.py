"""agoq: low-bit activations, gradients and communication for LLM training, tuned per layer."""

from agoq.cpu_isa import avoid_amx

avoid_amx()  # before any bf16 CPU work: oneDNN's AMX kernels fault on some hosts (agoq.cpu_isa)


from agoq.activations import (  # noqa: E402
    KINDS,
    ActivationPolicy,
    apply_activation_policy,
    preset,
    remove_activation_policy,
    stage_aware_policy,
    stage_bits,
    track_saved_tensors,
)
from agoq.comm import QuantizedGradients, quangrad_hook, quantized_all_reduce  # noqa: E402
from agoq.comm.fsdp import fully_shard_quantized  # noqa: E402
from agoq.comm.fsdp_collectives import TLQHSReduceScatter, use_quantized_reduce_scatter  # noqa: E402
from agoq.quant import QTensor, dequantize, quantize, quantized_nbytes  # noqa: E402

__version__ = "0.1.0"
__all__ = ["QTensor", "quantize", "dequantize", "quantized_nbytes", "ActivationPolicy", "KINDS", "preset",
           "stage_aware_policy", "stage_bits", "apply_activation_policy", "remove_activation_policy",
           "track_saved_tensors", "QuantizedGradients", "quangrad_hook", "quantized_all_reduce", "fully_shard_quantized",
           "use_quantized_reduce_scatter", "TLQHSReduceScatter", "__version__"]
