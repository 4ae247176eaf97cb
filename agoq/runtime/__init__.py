"""agoq's runtime: block quantization kernels, QTensor, and LAAQ activation compression."""

from agoq.runtime.qtensor import QTensor, quantized_nbytes
from agoq.runtime.quantize import dequantize, quantize

__all__ = ["QTensor", "quantize", "dequantize", "quantized_nbytes"]
