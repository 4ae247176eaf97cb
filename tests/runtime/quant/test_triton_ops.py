"""agoq's kernels as torch.library.triton_ops: how the ops are registered, the CUDA body (run here by the Triton
interpreter) against the CPU reference kernel, and eager against compiled (aot_eager) on non-round sizes. On a GPU
the last test checks that torch.compile traces the CUDA bodies down to the Triton kernels."""

import pytest
import torch

from agoq import triton_ops
from agoq.runtime.activations import rmsnorm, swiglu  # noqa: F401  (they define the norm and SwiGLU operators)
from agoq.runtime.quant import operators
from tests.backends import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = ("agoq::quantize_block", "agoq::dequantize_block", "agoq::rms_norm", "agoq::rms_norm_backward",
       "agoq::swiglu", "agoq::swiglu_backward")
SETTINGS = [(bits, block, fmt) for bits in (2, 3, 4, 5, 8) for block in (32, 128) for fmt in ("int", "nf4")
            if fmt == "int" or bits == 4]


def _opdef(name):
    from torch._library.custom_ops import OPDEFS

    return OPDEFS[name]


@pytest.mark.skipif(not triton_ops.HAS_TRITON_OP, reason="torch.library.triton_op needs torch >= 2.6")
@pytest.mark.parametrize("name", OPS)
def test_ops_are_triton_ops_with_a_cpu_kernel_and_a_traceable_body(name):
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    op = _opdef(name)
    assert "cpu" in op._backend_fns and None in op._backend_fns  # the reference, and the body for other devices
    assert op._backend_fns["cpu"] is not op._backend_fns[None]
    assert FunctionalTensorMode in op._torch_dispatch_fns  # AOTAutograd traces the body (where decompose allows)
    assert op._abstract_fn is not None
    pytest.importorskip("triton")
    import agoq.runtime.activations.rmsnorm_triton  # noqa: F401
    import agoq.runtime.activations.swiglu_triton  # noqa: F401
    import agoq.runtime.quant.block_triton  # noqa: F401

    assert torch._library.triton.get_triton_kernels_for_op(name), "kernels named for AOTAutograd's cache key"


def _random(n, seed, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 10).to(dtype).to(device)


@pytest.mark.parametrize("bits,block,fmt", SETTINGS)
def test_quantize_ops_eager_equals_compiled(bits, block, fmt, seed):
    x = _random(3 * block + 77, seed, device=DEVICE)  # non-round: a partial last block

    def roundtrip(x):
        data, scales = torch.ops.agoq.quantize_block(x, bits, block, fmt, "nearest", None)
        return data, scales, torch.ops.agoq.dequantize_block(data, scales, bits, block, x.numel(), fmt, x.dtype)

    eager = roundtrip(x)
    torch._dynamo.reset()
    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)(x)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits,block,fmt", SETTINGS)
@needs_triton
def test_quantize_body_equals_cpu_kernel(bits, block, fmt, seed):
    """The CUDA body (allocation, cached launch options, stand-in pointers) through the Triton interpreter."""
    x = _random(5 * block + 13, seed, device=DEVICE)
    data, scales = operators._quantize_body(x, bits, block, fmt, "nearest", None)
    ref_data, ref_scales = operators._quantize_cpu(x.cpu(), bits, block, fmt, "nearest", None)
    assert torch.equal(data.cpu(), ref_data) and torch.equal(scales.cpu(), ref_scales)
    back = operators._dequantize_body(data, scales, bits, block, x.numel(), fmt, torch.float32)
    assert torch.equal(back.cpu(), operators._dequantize_cpu(ref_data, ref_scales, bits, block, x.numel(), fmt,
                                                             torch.float32))


@pytest.mark.parametrize("want_output", [False, True])
def test_norm_and_swiglu_ops_eager_equals_compiled(want_output, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(torch.bfloat16).to(DEVICE)
    up = torch.randn(3, 7, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    grad = torch.randn(3, 7, 40, generator=g).to(torch.bfloat16).to(DEVICE)

    def run(x, w, up, grad):
        return (torch.ops.agoq.rms_norm(x, w, 1e-5), *torch.ops.agoq.rms_norm_backward(x, w, 1e-5, grad, want_output),
                torch.ops.agoq.swiglu(x, up), *torch.ops.agoq.swiglu_backward(x, up, grad, want_output))

    eager = run(x, w, up, grad)
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(x, w, up, grad)
    assert [t.shape for t in compiled] == [t.shape for t in eager]
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    if not want_output:
        assert eager[3].numel() == 0 and eager[7].numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_ops.HAS_TRITON_OP, reason="the CUDA bodies")
def test_compile_traces_cuda_bodies_down_to_the_kernels(monkeypatch):
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    x = _random(4 * 128 + 9, 5, device="cuda")
    w = torch.ones(x.numel(), dtype=x.dtype, device="cuda")

    def f(x, w):
        d, s = torch.ops.agoq.quantize_block(x, 4, 128, "int", "nearest", None)
        y = torch.ops.agoq.dequantize_block(d, s, 4, 128, x.numel(), "int", x.dtype)
        return torch.ops.agoq.swiglu(torch.ops.agoq.rms_norm(y.view(1, -1), w, 1e-5), y.view(1, -1))

    torch._dynamo.reset()
    out = torch.compile(f, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(x, w)
    assert torch.equal(out, f(x, w))
    text = "\n".join(graphs)
    assert "triton_kernel_wrapper" in text and "agoq." not in text, text
    monkeypatch.setattr(triton_ops, "DECOMPOSE", False)  # AGOQ_TRITON_OPS=0: opaque calls again
    graphs.clear()
    torch._dynamo.reset()
    torch.compile(f, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(x, w)
    assert "agoq.quantize_block" in "\n".join(graphs)
