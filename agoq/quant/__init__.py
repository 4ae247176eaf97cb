"""Block quantization: the bit formats everything else stores and sends.

`quantize(x, bits, block, ...)` gives a `QTensor` (packed codes + one float32 scale per block, 2..8 bits
or nf4; its byte layout in `layout`); the torch operators of `operators` run CUDA tensors through the Triton
kernels (`quantize_kernel`, `dequantize_kernel`, launched by `block_triton`), CPU tensors through the plain
torch reference they are tested against bit for bit (`reference`). A new bit format goes here.
"""

from agoq.quant.layout import quantized_nbytes
from agoq.quant.qtensor import QTensor
from agoq.quant.quantize import dequantize, quantize

__all__ = ["QTensor", "quantize", "dequantize", "quantized_nbytes"]
