"""The fused 8-bit AdamW step: Triton kernel (interpreter) == torch reference byte for byte, both against a
float64 AdamW, the gradient sources (QuanGrad codes, dense bf16 / float32), stochastic rounding, resume."""

import io
import math
import random

import pytest
import torch

from agoq.runtime.comm.quangrad import QuantizedGradients
from agoq.runtime.optim.adamw8bit import FusedAdamW8bit
from agoq.runtime.optim.fused_adamw import adamw8bit_step, dequantize_blocks, grad_norm_sq, quantize_blocks, sr_seed, zero_blocks

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled on a GPU, interpreted on the CPU
KERNEL_SIZES = [257, 4099, 1000, 3]  # small: the interpreter is slow; none a multiple of the block


def _seed():
    return random.getrandbits(24)  # seeded per test: tests/conftest.py


def _state(n, g, scale=1e-3):
    st = {"step": 0}
    st["exp_avg_codes"], st["exp_avg_scales"] = quantize_blocks(torch.randn(n, generator=g) * scale, 256)
    st["exp_avg_sqrt_codes"], st["exp_avg_sqrt_scales"] = quantize_blocks(torch.rand(n, generator=g) * scale, 256)
    return st


def _to(device, params, mlist, grads, states):
    """The step's inputs (or outputs) on `device`."""
    move = (lambda t: t.to(device))
    return ([move(p) for p in params], [move(m) for m in mlist] if mlist is not None else None,
            [tuple(map(move, g)) if isinstance(g, tuple) else move(g) for g in grads],
            [{k: move(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()} for st in states])


def _inputs(seed, pdtype, masters, gkind, sizes=KERNEL_SIZES, grad_block=256):
    g = torch.Generator().manual_seed(seed)
    params = [(torch.randn(n, generator=g) * 0.1).to(pdtype) for n in sizes]
    mlist = [p.float() + 1e-4 * torch.randn(p.shape, generator=g) for p in params] if masters else None
    states = [_state(n, g) for n in sizes]
    if gkind == "quangrad":
        grads = []
        for n in sizes:
            nb = -(-n // grad_block)
            codes = torch.randint(0, 255, (nb * grad_block,), generator=g, dtype=torch.uint8)
            codes[n:] = 127  # padding is zero
            grads.append((codes, torch.rand(nb, generator=g) * 1e-4))
    else:
        grads = [(torch.randn(n, generator=g) * 1e-2).to(gkind) for n in sizes]
    return params, mlist, grads, states


@pytest.mark.parametrize("pdtype,masters,gkind,step", [
    (torch.bfloat16, True, "quangrad", 1), (torch.bfloat16, True, torch.bfloat16, 50),
    (torch.float32, False, torch.float32, 50), (torch.float32, False, "quangrad", 7),
])
def test_kernel_equals_reference_bit_for_bit(pdtype, masters, gkind, step):
    """Same operations in the same order, each rounded once: identical bytes (params, masters, codes, scales)."""
    seed = _seed()
    out = []
    for backend in ("reference", "triton"):
        inputs = _inputs(seed, pdtype, masters, gkind)
        params, mlist, grads, states = _to(DEVICE, *inputs) if backend == "triton" else inputs
        adamw8bit_step(params, mlist, grads, states, **HP, step=step, clip=0.37, backend=backend)
        params, mlist, _, states = _to("cpu", params, mlist, grads, states)
        out.append((params, mlist, states))
    (p1, m1, s1), (p2, m2, s2) = out
    for a, b in zip(p1, p2):
        assert torch.equal(a, b), f"seed {seed}"
    for a, b in zip(m1 or [], m2 or []):
        assert torch.equal(a, b), f"seed {seed}"
    for a, b in zip(s1, s2):
        for k in ("exp_avg_codes", "exp_avg_scales", "exp_avg_sqrt_codes", "exp_avg_sqrt_scales"):
            assert torch.equal(a[k], b[k]), f"seed {seed}: {k}"


def _adamw64(p, m, v, g, step, lr, betas, eps, weight_decay):
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * weight_decay) - lr / (1 - b1 ** step) * m / (v.sqrt() / math.sqrt(1 - b2 ** step) + eps)
    return p, m, v


@pytest.mark.parametrize("step", [1, 50])
@pytest.mark.parametrize("gkind", ["quangrad", torch.bfloat16, torch.float32])
def test_reference_follows_float64_adamw(step, gkind):
    """One step from the same (dequantized) state against float64 AdamW with the clip factor, weight decay and
    bias correction at step 1 and 50, 1000003 values: the master is within float32 rounding of the float64
    result, the new
    moments within one float8 e4m3 step (3 mantissa bits: 2**-4 relative, plus the block's smallest step)."""
    seed = _seed()
    sizes = [257, 4099, 65537, 930110]  # 1000003 values
    params, mlist, grads, states = _inputs(seed, torch.bfloat16, True, gkind, sizes)
    clip = 0.61
    expect = []
    for p, mas, gr, st, n in zip(params, mlist, grads, states, sizes):
        if isinstance(gr, tuple):
            g64 = ((gr[0].double() - 127).view(-1, 256) * gr[1].double()[:, None]).reshape(-1)[:n]
        else:
            g64 = gr.double()
        m0 = dequantize_blocks(st["exp_avg_codes"], st["exp_avg_scales"], n, torch.float64)
        v0 = dequantize_blocks(st["exp_avg_sqrt_codes"], st["exp_avg_sqrt_scales"], n, torch.float64) ** 2
        b1, b2 = HP["betas"]
        p64, m64, v64 = _adamw64(mas.double(), m0, v0, g64 * clip, step, **HP)
        denom = v64.sqrt() / math.sqrt(1 - b2 ** step) + HP["eps"]
        # float32's error bound: a few roundings of each term's magnitude (m can cancel: beta1 m0 ~ -(1-beta1) g)
        scale = mas.double().abs() + HP["lr"] / (1 - b1 ** step) * (b1 * m0.abs() + (1 - b1) * (g64 * clip).abs()) / denom
        expect.append((scale, p64, m64, v64))
    adamw8bit_step(params, mlist, grads, states, **HP, step=step, clip=clip, backend="reference")
    for p, mas, st, (scale, p64, m64, v64), n in zip(params, mlist, states, expect, sizes):
        err = (mas.double() - p64).abs()
        assert (err <= scale * 1e-6 + 1e-12).all(), f"seed {seed}: {(err / scale).max().item()}"
        assert torch.equal(p, mas.bfloat16())
        for codes, scales, exact in ((st["exp_avg_codes"], st["exp_avg_scales"], m64),
                                     (st["exp_avg_sqrt_codes"], st["exp_avg_sqrt_scales"], v64.sqrt())):
            got = dequantize_blocks(codes, scales, n, torch.float64)
            tol = exact.abs() * 2**-4 + scales.double().repeat_interleave(256)[:n] * 2**-9 * 1.01
            assert ((got - exact).abs() <= tol).all(), f"seed {seed}"


def test_grad_norm_sq_kernel_and_reference_agree_with_float64():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (257, 4099, 1000, 5)]
    qg = QuantizedGradients(params, capture=False)
    dense = [torch.randn(p.shape, generator=g) for p in params]
    for p, d in zip(params, dense):
        qg.add_(p, d)
    values = (qg.codes.double() - 127).view(-1, qg.block) * qg.scales.double()[:, None]
    exact = (values ** 2).sum()
    torch.testing.assert_close(grad_norm_sq(qg, backend="reference"), exact, rtol=1e-12, atol=0)
    qg.codes, qg.scales = qg.codes.to(DEVICE), qg.scales.to(DEVICE)
    torch.testing.assert_close(grad_norm_sq(qg, backend="triton").cpu(), exact, rtol=1e-12, atol=0)
    bf = [d.bfloat16() for d in dense] + [torch.randn(7, generator=g)]
    exact = sum((d.double() ** 2).sum() for d in bf)
    torch.testing.assert_close(grad_norm_sq(bf, backend="reference"), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_norm_sq([d.to(DEVICE) for d in bf], backend="triton").cpu(), exact, rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("grad_block", [64, 1024])
def test_kernel_reads_gradient_blocks_of_another_size(grad_block):
    """QuanGrad blocks smaller than the moments' (a scale per value) and larger (a scale per row of the tile)."""
    seed = _seed()
    out = []
    for backend in ("reference", "triton"):
        inputs = _inputs(seed, torch.bfloat16, True, "quangrad", grad_block=grad_block)
        params, mlist, grads, states = _to(DEVICE, *inputs) if backend == "triton" else inputs
        adamw8bit_step(params, mlist, grads, states, **HP, step=3, clip=0.61, grad_block=grad_block, backend=backend)
        params, mlist, _, states = _to("cpu", params, mlist, grads, states)
        out.append((params, mlist, states))
    (p1, m1, s1), (p2, m2, s2) = out
    assert all(torch.equal(a, b) for a, b in zip(p1, p2)) and all(torch.equal(a, b) for a, b in zip(m1, m2))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(s1, s2) for k in ("exp_avg_codes", "exp_avg_sqrt_codes"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_stochastic_rounding_is_unbiased(backend):
    """Without a master the bf16 parameter gets the float32 result plus random low bits, truncated: over many
    draws its mean is the float32 result (nearest rounding would stay a fixed fraction of an ulp off).
    Zero gradient and moments leave only the decay: p = RN32(p0 * (1 - lr * wd)), between bf16 values."""
    seed = _seed()
    n, draws = 512, 200 if backend == "reference" else 40
    start = (1.0 + torch.arange(n) * 2**-9).bfloat16()  # bf16 values in [1, 2)
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.5)
    exact = (start.float() * torch.tensor(1 - 1e-3 * 0.5, dtype=torch.float32)).double()
    total = torch.zeros(n, dtype=torch.float64)
    device = DEVICE if backend == "triton" else "cpu"
    for d in range(draws):
        p = start.clone().to(device)
        st = {k: v.to(device) if isinstance(v, torch.Tensor) else v
              for k, v in _state(n, torch.Generator().manual_seed(0), scale=0.0).items()}
        adamw8bit_step([p], None, [torch.zeros(n, device=device)], [st], **hp, step=1, seeds=[sr_seed(seed, 1, d)],
                       backend=backend)
        total += p.double().cpu()
    mean = total / draws
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    # a mean of `draws` Bernoulli ulp steps: standard error <= ulp / (2 sqrt(draws)); 5 sigma
    assert ((mean - exact).abs() <= 5 * ulp / (2 * math.sqrt(draws))).all(), f"seed {seed}"
    nearest = (exact.float().bfloat16().double() - exact).abs().mean()
    assert (mean - exact).abs().mean() < nearest / 2, f"seed {seed}: no better than nearest rounding"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_stochastic_rounding_draws_independent_bits_per_value(backend):
    """Every value draws its own random bits (the kernel splits one Philox call over 8 values): a constant
    parameter whose decayed value lies halfway between two bf16 numbers rounds up or down by a fair coin per
    value, so in one draw about half go up, and a group of 8 neighbours all agree with probability 2/256
    (it would be 1 if neighbours shared their bits). n is not a multiple of 8 or of the block."""
    seed = _seed()
    n = 12_347
    hp = dict(lr=2.0**-9, betas=(0.9, 0.95), eps=1e-8, weight_decay=1.0)  # decay 1 - 2**-9: halfway below 1.0
    device = DEVICE if backend == "triton" else "cpu"
    p = torch.ones(n, dtype=torch.bfloat16, device=device)
    st = {k: v.to(device) if isinstance(v, torch.Tensor) else v
          for k, v in _state(n, torch.Generator().manual_seed(0), scale=0.0).items()}
    adamw8bit_step([p], None, [torch.zeros(n, device=device)], [st], **hp, step=1, seeds=[sr_seed(seed, 1, 0)],
                   backend=backend)
    up = p.cpu().double()
    assert set(up.unique().tolist()) <= {1.0, 1.0 - 2.0**-8}, f"seed {seed}"
    up = (up == 1.0).double()
    assert abs(up.mean().item() - 0.5) <= 5 * 0.5 / math.sqrt(n), f"seed {seed}: {up.mean().item()}"
    groups = up[: n // 8 * 8].view(-1, 8).sum(dim=1)
    agree = ((groups == 0) | (groups == 8)).double().mean().item()
    assert agree < 0.03, f"seed {seed}: {agree:.3f} of 8-value groups rounded alike"


def _model(seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in ((61, 67), (4099,), (33,))]


def _grads(params, step, seed):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


@pytest.mark.parametrize("masters", [True, False])
def test_state_dict_round_trip_resumes_exactly(masters):
    """Save after 3 of 6 steps, load into a fresh optimizer: the same parameters as the uninterrupted run."""
    seed = _seed()

    def run(split):
        params = _model(seed)
        opt = FusedAdamW8bit(params, **HP, masters=masters, min_8bit_numel=1000, seed=seed)
        for step in range(6):
            if step == split:
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                buf.seek(0)
                opt = FusedAdamW8bit(params, **HP, masters=masters, min_8bit_numel=1000, seed=seed)
                opt.load_state_dict(torch.load(buf, weights_only=True))
            opt.step(grads=_grads(params, step, seed), clip_scale=0.5)
        return params, opt

    whole, _ = run(None)
    cut, opt = run(3)
    for a, b in zip(whole, cut):
        assert torch.equal(a, b), f"seed {seed}"
    st = opt.state[cut[0]]
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_scales"].dtype == torch.float32
    assert ("master" in st) == masters and (not masters or st["master"].dtype == torch.float32)
    assert "exp_avg" in opt.state[cut[2]]  # 33 values: exact moments


def test_quangrad_source_equals_its_dequantized_gradients():
    """step(grads=QuantizedGradients) reads the codes in place: the same bytes as handing it the float32
    gradients that QuanGrad would dequantize (the dequantized value is (code - 127) * scale either way)."""
    seed = _seed()
    results = []
    for source in ("codes", "float32"):
        params = _model(seed)
        qg = QuantizedGradients(params, capture=False)
        opt = FusedAdamW8bit(params, **HP, masters=True, min_8bit_numel=1000)
        for step in range(3):
            qg.zero_()
            for p, gr in zip(params, _grads(params, step, seed)):
                qg.add_(p, gr)
            if source == "codes":
                opt.step(grads=qg, clip_scale=0.8)
            else:
                opt.step(grads=[qg.gradient(p) for p in params], clip_scale=0.8)
        results.append(params)
    for a, b in zip(*results):
        assert torch.equal(a, b), f"seed {seed}"


def test_fused_optimizer_follows_float64_adamw_over_steps():
    """30 steps of a noisy quadratic, 8-bit moments and float32 masters: the distance travelled within 7 % of
    float64 AdamW's (the tolerance of AdamW8bit's own test, 3 mantissa bits per moment)."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(4099, generator=g, dtype=torch.float64)
    w0 = torch.randn(4099, generator=g, dtype=torch.float64) * 0.1
    noise = [torch.randn(4099, generator=g, dtype=torch.float64) * 0.3 for _ in range(30)]
    ref = w0.clone().requires_grad_()
    opt_ref = torch.optim.AdamW([ref], **HP)
    p = torch.nn.Parameter(w0.bfloat16())
    opt = FusedAdamW8bit([p], **HP, masters=True, min_8bit_numel=0)
    for nz in noise:
        ref.grad = (ref.detach() - target) + nz
        opt_ref.step()
        master = opt.state[p]["master"].double() if opt.state.get(p) else w0.float().double()
        opt.step(grads=[((master - target) + nz).float()], clip_scale=1.0)
    got = opt.state[p]["master"].double() - w0.float().double()
    rel = ((got - (ref.detach() - w0)).norm() / (ref.detach() - w0).norm()).item()
    assert rel < 0.07, f"seed {seed}: {rel:.4f}"


def test_fresh_moments_are_what_quantizing_zeros_stores():
    """zero_blocks builds a fresh 8-bit moment without a float32 temporary: the same bytes and scales as
    quantize_blocks of float32 zeros (the reference), at sizes that are not multiples of the block."""
    rng = random.Random(random.getrandbits(32))
    for _ in range(6):
        block = rng.choice([32, 128, 256])
        n = rng.randint(1, 5000) * rng.choice([1, 7, 13]) + rng.randint(0, block - 1)
        codes, scales = zero_blocks(n, block, "cpu")
        ref_codes, ref_scales = quantize_blocks(torch.zeros(n), block)
        assert codes.dtype == ref_codes.dtype and scales.dtype == ref_scales.dtype
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales), (n, block)
        assert torch.equal(dequantize_blocks(codes, scales, n), torch.zeros(n))


def test_dense_norm_follows_gradients_that_moved():
    """The norm's pointer table is kept across calls and keyed by its content: gradients in new memory (the
    allocator may place them elsewhere each step) are read from there, never from the old addresses."""
    g = torch.Generator().manual_seed(_seed())
    for _ in range(3):
        grads = [torch.randn(n, generator=g).bfloat16().to(DEVICE) for n in (513, 77, 2049)]
        exact = sum((d.double() ** 2).sum() for d in grads).cpu()
        torch.testing.assert_close(grad_norm_sq(grads, backend="triton").cpu(), exact, rtol=1e-6, atol=0)
        del grads  # the next ones may land on the same addresses, or not


def test_device_tables_keep_the_recently_used():
    from agoq.runtime.optim import fused_adamw_triton as kernels

    made = []

    def maker(i):
        return lambda: made.append(i) or torch.tensor([i])

    kernels._DEVICE_TABLES.clear()
    first = kernels._on_device(("test", 0), maker(0), torch.device("cpu"))
    for i in range(1, kernels._MAX_TABLES + 5):
        assert kernels._on_device(("test", 0), maker(0), torch.device("cpu")) is first  # used every time: kept
        kernels._on_device(("test", i), maker(i), torch.device("cpu"))
    assert made.count(0) == 1 and len(kernels._DEVICE_TABLES) == kernels._MAX_TABLES
    assert ("test", 1) not in kernels._DEVICE_TABLES  # the least recently used went
    kernels._DEVICE_TABLES.clear()
