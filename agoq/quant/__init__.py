"""Block quantization: the bit formats everything else stores and sends.

`quantize(x, bits, block, ...)` gives a `QTensor` (packed codes + one float32 scale per block, 2..8 bits
or nf4; its byte layout in `layout`); the torch operators of `operators` run CUDA tensors through the Triton
kernels (`quantize_kernel`, `dequantize_kernel`, launched by `block_triton`), CPU tensors through the plain
torch reference they are tested against bit for bit (`reference`). A new bit format goes here.
"""

import importlib

_HOMES = {  # public name -> the module that defines it
    "QTensor": "agoq.quant.qtensor", "quantize": "agoq.quant.codec", "dequantize": "agoq.quant.codec",
    "quantized_nbytes": "agoq.quant.layout",
}

__all__ = list(_HOMES)


def __getattr__(name: str):  # PEP 562: a public name loads its home module on first use, so that importing a
    home = _HOMES.get(name)  # light submodule (e.g. agoq.quant.layout) does not load the kernels
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
