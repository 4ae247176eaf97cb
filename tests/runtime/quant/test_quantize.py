"""Block quantization: Triton kernels vs the torch reference, and both vs closed-form bounds."""

import math

import pytest
import torch

import agoq
from agoq.runtime.quant.codebook import nf4_levels
from agoq.runtime.quant.qtensor import int_qmax, packed_nbytes, quantized_nbytes
from agoq.runtime.quant.codec import dequantize, quantize
from tests.backends import BACKENDS, DEVICE, needs_triton

ALL_BITS = list(range(2, 9))


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def fresh(shape, dtype=torch.float32, scale=1.0):
    """Gaussian values from torch's global generator (seeded per test by tests/conftest.py)."""
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("block", [32, 128, 512])
def test_kernel_bytes_equal_reference(bits, block):
    """Triton and torch produce the same packed bytes and scales, on sizes that divide nothing."""
    x = fresh((3, 331), torch.float32)
    ref = quantize(x, bits, block, backend="torch")
    out = quantize(x, bits, block, backend="triton")
    assert torch.equal(ref.scales, out.scales)
    assert torch.equal(ref.data, out.data)
    back_ref = dequantize(ref, torch.float32, backend="torch")
    back = dequantize(out, torch.float32, backend="triton")
    assert torch.equal(back_ref, back)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", ALL_BITS)
def test_round_trip_within_analytic_bound(backend, dtype, bits):
    """Nearest rounding: every value within scale/2 of the source (+ the output dtype's rounding)."""
    block = 64
    x = fresh((5, 3, 97), dtype, scale=3.7)
    q = quantize(x, bits, block, backend=backend)
    assert q.data.numel() == packed_nbytes(x.numel(), bits)
    assert q.nbytes == quantized_nbytes(x.numel(), bits, block)
    back = dequantize(q, torch.float32, backend=backend)
    flat = x.double().reshape(-1)
    n = flat.numel()
    pad = torch.zeros(math.ceil(n / block) * block, dtype=torch.float64, device=flat.device)
    pad[:n] = flat
    absmax = pad.view(-1, block).abs().amax(1)
    bound = (absmax / int_qmax(bits) / 2).repeat_interleave(block)[:n]
    err = (back.double().reshape(-1) - flat).abs()
    # float32 arithmetic adds a few roundings of the value itself (scale, 1/scale, code * scale)
    fp32_slack = 4 * 2.0**-24 * flat.abs()
    assert (err <= bound * (1 + 1e-5) + fp32_slack + 1e-30).all(), f"max excess {(err - bound).max().item()}"
    # in the tensor's own dtype the result differs from the float32 one by at most one rounding (1 ulp)
    same_dtype = dequantize(q, backend=backend).double()
    ulp = torch.finfo(dtype).eps * back.double().abs()
    assert ((same_dtype - back.double()).abs() <= ulp + 1e-30).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_halves_per_bit(backend):
    """Relative L2 error on Gaussian data shrinks about 2x per extra bit (uniform levels)."""
    x = fresh((4099,), torch.float32)
    errs = [rel_l2(quantize(x, b, 128, backend=backend).dequantize(), x) for b in range(3, 9)]
    for lo, hi in zip(errs, errs[1:]):
        assert 1.6 < lo / hi < 2.6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [2, 4, 5, 8])
def test_stochastic_rounding_is_unbiased(backend, bits):
    """Each code is floor or ceil of the scaled value, and the mean error shrinks like 1/sqrt(samples)."""
    x = fresh((1, 259), torch.float32)
    qmax = int_qmax(bits)
    samples = []
    for s in range(64):
        q = quantize(x, bits, 32, rounding="stochastic", seed=1000 + s, backend=backend)
        samples.append(q.dequantize(torch.float64))
    stack = torch.stack(samples)
    scale = q.scales.double().repeat_interleave(32)[: x.numel()].view_as(x)
    v = x.double() / scale
    lo, hi = torch.floor(v).clamp(-qmax, qmax), torch.ceil(v).clamp(-qmax, qmax)
    codes = stack / scale
    tol = 1e-6 * (1 + codes.abs())  # dequantized in float32: relative rounding of code * scale
    assert ((codes - lo).abs().le(tol) | (codes - hi).abs().le(tol)).all()
    bias_8 = (stack[:8].mean(0) - x.double()).abs().mean()
    bias_64 = (stack.mean(0) - x.double()).abs().mean()
    nearest = (quantize(x, bits, 32, backend=backend).dequantize(torch.float64) - x.double()).abs().mean()
    assert bias_64 < bias_8 * 0.6  # ~ 1/sqrt(8) expected
    assert bias_64 < nearest or bits == 8


def test_stochastic_seed_reproducible():
    x = fresh((1000,))
    a = quantize(x, 4, rounding="stochastic", seed=7)
    b = quantize(x, 4, rounding="stochastic", seed=7)
    c = quantize(x, 4, rounding="stochastic", seed=8)
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_nf4_codebook(backend, rounding):
    """nf4: nearest picks the closest level (brute force); stochastic is unbiased between neighbours."""
    x = fresh((3, 113), torch.float32)
    q = quantize(x, 4, 32, rounding=rounding, format="nf4", seed=3, backend=backend)
    assert q.data.numel() == packed_nbytes(x.numel(), 4)
    back = q.dequantize(torch.float64).reshape(-1)
    scale = q.scales.double().repeat_interleave(32)[: x.numel()]
    levels = nf4_levels().double().to(x.device)
    v = x.double().reshape(-1) / scale
    dist = (v[:, None] - levels[None, :]).abs()
    if rounding == "nearest":
        best = levels[dist.argmin(1)] * scale
        assert torch.allclose(back, best, rtol=1e-6, atol=1e-12)
    else:
        codes = back / scale
        below = levels[(v[:, None] >= levels[None, :]).sum(1).clamp(1, 15) - 1]
        above = levels[(v[:, None] > levels[None, :]).sum(1).clamp(0, 15)]
        ok = ((codes - below).abs() < 1e-6) | ((codes - above).abs() < 1e-6)
        assert ok.all()


def test_nf4_beats_int4_on_gaussian():
    x = fresh((8191,))
    assert rel_l2(quantize(x, 4, 64, format="nf4").dequantize(), x) < rel_l2(quantize(x, 4, 64).dequantize(), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zeros_constant_huge_tiny(backend):
    """Zero blocks stay exactly zero, constant blocks are exact, extreme magnitudes neither overflow nor vanish."""
    block = 32
    parts = [
        torch.zeros(block),                      # all zeros
        torch.full((block,), -2.75),             # constant: absmax level is exact
        torch.randn(block) * 1e37,               # huge, near the float32 limit
        torch.randn(block) * 1e-30,              # tiny normals
        torch.randn(block) * 1e-41,              # subnormals
        torch.randn(17),                         # a partial last block
    ]
    x = torch.cat(parts).to(DEVICE)
    q = quantize(x, 4, block, backend=backend)
    back = q.dequantize(torch.float64)
    assert (back[:block] == 0).all()
    assert torch.equal(back[block:2 * block], x[block:2 * block].double())
    for i in (2, 3, 4):
        seg = slice(i * block, (i + 1) * block)
        assert torch.isfinite(back[seg]).all()
        assert rel_l2(back[seg], x[seg]) < 0.25


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input(backend, bad):
    """inf/NaN: a clear error by default; with check_finite=False only the holding block turns NaN."""
    x = fresh((300,))
    x[150] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(x, 4, 64, backend=backend)
    q = quantize(x, 4, 64, check_finite=False, backend=backend)
    back = q.dequantize(torch.float32)
    assert torch.isnan(back[128:192]).all()
    assert torch.isfinite(back[:128]).all() and torch.isfinite(back[192:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_view_round_trips_without_copy(backend):
    x = fresh((37, 3, 29)).transpose(0, 2)
    q = quantize(x, 8, 32, backend=backend)
    assert q.order is not None
    back = q.dequantize()
    assert back.shape == x.shape and back.stride() == x.stride()
    assert rel_l2(back, x) < 0.01


def test_empty_and_public_entry_point():
    q = agoq.quantize(torch.empty(0, 5), 5)
    assert q.nbytes == 0 and q.dequantize().shape == (0, 5)
    x = fresh((10,))
    assert isinstance(agoq.quantize(x, 6, block=32, rounding="nearest"), agoq.QTensor)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=1), "bits must be an integer from 2 to 8"),
    (dict(bits=16), "bits must be an integer from 2 to 8"),
    (dict(bits=4.0), "bits must be an integer"),
    (dict(bits=4, block=100), "power of two"),
    (dict(bits=4, block=16), "power of two from 32"),
    (dict(bits=4, rounding="up"), "rounding must be one of"),
    (dict(bits=5, format="nf4"), "bits must be 4"),
    (dict(bits=4, format="fp4"), "format must be one of"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize(torch.randn(64), **kwargs)


def test_integer_input_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.arange(10), 4)
