"""agoq: low-bit activations, gradients and communication for LLM training, tuned per layer."""

from agoq.runtime import QTensor, dequantize, quantize, quantized_nbytes

__version__ = "0.1.0"
__all__ = ["QTensor", "quantize", "dequantize", "quantized_nbytes", "__version__"]
