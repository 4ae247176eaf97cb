"""Block quantization: the bit formats everything else stores and sends.

`quantize(x, bits, block, ...)` gives a `QTensor` (packed codes + one float32 scale per block, 2..8 bits
or nf4; its byte layout in `layout`); the torch operators of `operators` run CUDA tensors through the Triton
kernels (`quantize_kernel`, `dequantize_kernel`, launched by `block_triton`), CPU tensors through the plain
torch reference they are tested against bit for bit (`reference`). A new bit format goes here.
"""

from agoq.lazy import lazy_exports

_HOMES = {  # public name -> the module that defines it
    "QTensor": "agoq.runtime.quant.qtensor", "quantize": "agoq.runtime.quant.codec", "dequantize": "agoq.runtime.quant.codec",
    "quantized_nbytes": "agoq.runtime.quant.layout",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)  # each name loads its home on first use
