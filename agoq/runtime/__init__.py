"""agoq's runtime: block quantization kernels, QTensor, and LAAQ activation compression."""

from agoq.runtime.qtensor import QTensor, quantized_nbytes
from agoq.runtime.quantize import dequantize, quantize

__all__ = ["QTensor", "quantize", "dequantize", "quantized_nbytes"]

from agoq.runtime.laaq import apply_activation_policy, remove_activation_policy  # noqa: E402
from agoq.runtime.policy import KINDS, ActivationPolicy, preset, stage_aware_policy, stage_bits  # noqa: E402
from agoq.runtime.saved_bytes import track_saved_tensors  # noqa: E402

__all__ += ["apply_activation_policy", "remove_activation_policy", "ActivationPolicy", "KINDS", "preset",
            "stage_aware_policy", "stage_bits", "track_saved_tensors"]

from agoq.runtime.quangrad import QuantizedGradients, quangrad_hook  # noqa: E402
from agoq.runtime.quantized_allreduce import quantized_all_reduce  # noqa: E402

__all__ += ["QuantizedGradients", "quangrad_hook", "quantized_all_reduce"]

from agoq.runtime.sdp4bit import SDP4BitOptimizer, qwd_all_gather, tlq_hs_reduce_scatter  # noqa: E402

__all__ += ["SDP4BitOptimizer", "qwd_all_gather", "tlq_hs_reduce_scatter"]
