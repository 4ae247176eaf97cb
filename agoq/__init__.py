"""agoq: low-bit activations, gradients and communication for LLM training, tuned per layer.

The names below load on first use (PEP 562), so `import agoq` and its light modules (units, files,
formats) do not import the kernels: `agoq.quantize` imports agoq.quant when it is first read.
"""

from agoq.cpu_isa import avoid_amx
from agoq.lazy import lazy_exports

avoid_amx()  # before any bf16 CPU work: oneDNN's AMX kernels fault on some hosts (agoq.cpu_isa); reads no torch

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "QTensor": "agoq.quant", "quantize": "agoq.quant", "dequantize": "agoq.quant", "quantized_nbytes": "agoq.quant",
    "ActivationPolicy": "agoq.activations", "KINDS": "agoq.activations", "preset": "agoq.activations",
    "stage_aware_policy": "agoq.activations", "stage_bits": "agoq.activations",
    "apply_activation_policy": "agoq.activations", "remove_activation_policy": "agoq.activations",
    "track_saved_tensors": "agoq.activations",
    "QuantizedGradients": "agoq.comm", "quangrad_hook": "agoq.comm", "quantized_all_reduce": "agoq.comm",
    "fully_shard_quantized": "agoq.comm.fsdp", "apply_weight_gather": "agoq.comm.fsdp_weight_gather",
    "use_quantized_reduce_scatter": "agoq.comm.fsdp_collectives", "TLQHSReduceScatter": "agoq.comm.fsdp_collectives",
}

__all__ = [*_HOMES, "__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
