"""agoq: low-bit activations, gradients and communication for LLM training, tuned per layer.

The names below load on first use (PEP 562), so `import agoq` and its light modules (units, files,
formats) do not import the kernels: `agoq.quantize` imports agoq.runtime.quant when it is first read.
"""

from agoq.cpu_isa import avoid_amx
from agoq.lazy import lazy_exports

avoid_amx()  # before any bf16 CPU work: oneDNN's AMX kernels fault on some hosts (agoq.cpu_isa); reads no torch

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "QTensor": "agoq.runtime.quant", "quantize": "agoq.runtime.quant", "dequantize": "agoq.runtime.quant", "quantized_nbytes": "agoq.runtime.quant",
    "ActivationPolicy": "agoq.runtime.activations", "KINDS": "agoq.runtime.activations", "preset": "agoq.runtime.activations",
    "stage_aware_policy": "agoq.runtime.activations", "stage_bits": "agoq.runtime.activations",
    "apply_activation_policy": "agoq.runtime.activations", "remove_activation_policy": "agoq.runtime.activations",
    "track_saved_tensors": "agoq.runtime.activations",
    "QuantizedGradients": "agoq.runtime.comm", "quangrad_hook": "agoq.runtime.comm", "quantized_all_reduce": "agoq.runtime.comm",
    "fully_shard_quantized": "agoq.runtime.comm.fsdp", "apply_weight_gather": "agoq.runtime.comm.fsdp_weight_gather",
    "use_quantized_reduce_scatter": "agoq.runtime.comm.fsdp_collectives", "TLQHSReduceScatter": "agoq.runtime.comm.fsdp_collectives",
}

__all__ = [*_HOMES, "__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
