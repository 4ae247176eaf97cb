"""QuanGrad: the 8-bit gradient buffer and the DDP hook, against exact gradients."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from agoq.runtime.comm.quangrad import QuantizedGradients, quangrad_hook
from tests.backends import needs_triton
from tests.multiprocess import run_workers

# documented bounds (relative L2 vs exact float64 gradients)
BUFFER_REL_ERR_BOUND = 0.02  # 4 micro-batches: each requantization adds ~0.6 %, so ~0.6 % x sqrt(4)
DDP_REL_ERR_BOUND = 0.02  # real layer gradients have heavier tails than Gaussian ones: two roundings, ~1 %


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(37, 301), nn.GELU(), nn.Linear(301, 13))


def _batch(seed, rank, micro):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 101 + micro)
    return torch.randn(29, 37, generator=g), torch.randn(29, 13, generator=g)


def test_buffer_accumulates_micro_batches_and_saves_memory(seed):
    model = _model(seed)
    ref = _model(seed).double()
    qg = QuantizedGradients(model.parameters())
    for micro in range(4):
        x, y = _batch(seed, 0, micro)
        nn.functional.mse_loss(model(x), y).backward()
        nn.functional.mse_loss(ref(x.double()), y.double()).backward()
        assert all(p.grad is None for p in model.parameters())  # captured into the 8-bit buffer
    num = sum(((qg.gradient(p).double() - r.grad) ** 2).sum() for p, r in zip(model.parameters(), ref.parameters()))
    den = sum((r.grad ** 2).sum() for r in ref.parameters())
    assert (num / den).sqrt() < BUFFER_REL_ERR_BOUND, f"seed {seed}"
    qg.to_grads()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    qg.zero_()
    assert all((qg.gradient(p) == 0).all() for p in model.parameters())


def test_scale_multiplies_every_stored_gradient(seed):
    """scale_(f): each gradient becomes f times what it was, up to float32 roundings (f, the new scale, and
    code x scale: 4 half-ulps with the old value's own)."""
    model = _model(seed)
    qg = QuantizedGradients(model.parameters())
    x, y = _batch(seed, 0, 0)
    nn.functional.mse_loss(model(x), y).backward()
    before = [qg.gradient(p).double() for p in model.parameters()]
    factor = 1 / (2 + seed % 5)  # the pipeline's 1 / micro-batches
    qg.scale_(factor)
    for p, b in zip(model.parameters(), before):
        want = b * factor
        assert ((qg.gradient(p).double() - want).abs() <= 4 * 2.0**-24 * want.abs()).all()
    assert any((b != 0).any() for b in before)


def test_gradient_memory_of_llm_shaped_layers():
    """<= 0.52x a bf16 gradient buffer (parameters are padded to whole blocks: LLM shapes need none)."""
    layers = nn.ModuleList([nn.Linear(1024, 3072, bias=False), nn.Linear(3072, 1024, bias=False),
                            nn.LayerNorm(1024, bias=False)])
    qg = QuantizedGradients(layers.parameters())
    bf16_bytes = 2 * sum(p.numel() for p in layers.parameters())
    assert qg.nbytes <= 0.52 * bf16_bytes
    qg.remove()


def _ddp_worker(rank, world, seed):
    model = _model(seed)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    ddp.register_comm_hook(None, quangrad_hook)
    x, y = _batch(seed, rank, 0)
    nn.functional.mse_loss(ddp(x), y).backward()
    grads_hook = [p.grad.clone() for p in model.parameters()]
    # the 8-bit buffer path: capture, all-reduce, read back
    model2 = _model(seed)
    qg = QuantizedGradients(model2.parameters())
    nn.functional.mse_loss(model2(x), y).backward()
    qg.all_reduce(average=True)
    grads_buffer = [qg.gradient(p) for p in model2.parameters()]
    # small buckets, reduced after backward and overlapped with it: the same bytes either way
    bucketed = []
    for overlap in (False, True):
        m = _model(seed)
        q = QuantizedGradients(m.parameters(), bucket_bytes=3000, overlap=overlap)
        assert len(q.buckets) > 2
        if overlap:
            q.prepare_sync()
        nn.functional.mse_loss(m(x), y).backward()
        q.all_reduce(average=True)
        bucketed.append([q.gradient(p) for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*bucketed))
    dist.barrier()
    return grads_hook, grads_buffer, bucketed[1]


def test_ddp_hook_and_buffer_all_reduce(seed):
    world = 3
    results = run_workers(_ddp_worker, world, seed)
    ref = _model(seed).double()
    for r in range(world):
        x, y = _batch(seed, r, 0)
        (nn.functional.mse_loss(ref(x.double()), y.double()) / world).backward()
    exact = [p.grad for p in ref.parameters()]
    for which in (0, 1, 2):
        got = results[0][which]
        for r in range(world):
            assert all(torch.equal(a, b) for a, b in zip(results[r][which], got)), f"seed {seed} rank {r} differs"
        num = sum(((g.double() - e) ** 2).sum() for g, e in zip(got, exact))
        den = sum((e ** 2).sum() for e in exact)
        assert (num / den).sqrt() < DDP_REL_ERR_BOUND, f"seed {seed} path {which}"


def _train_worker(rank, world, seed, use_quangrad):
    from agoq.models import build

    model = build("llama-tiny", dtype=torch.float32, seed=seed)
    ddp = nn.parallel.DistributedDataParallel(model)
    if use_quangrad:
        ddp.register_comm_hook(None, quangrad_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # a learnable synthetic language: each token is the previous one plus a rank-independent offset
    losses = []
    for step in range(60):
        g = torch.Generator().manual_seed(seed + 1000 * step + rank)
        start = torch.randint(0, 256, (4, 1), generator=g)
        ids = (start + torch.arange(33) * 7) % 256
        loss = ddp(ids[:, :-1], ids[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-5:]) / 5


def test_short_training_matches_plain_gradients(seed):
    """llama-tiny, 2 processes, 60 steps: QuanGrad's final loss within 2 % of plain fp32 all-reduce."""
    plain = run_workers(_train_worker, 2, seed, False)[0]
    quangrad = run_workers(_train_worker, 2, seed, True)[0]
    assert plain < 4.0, f"seed {seed}: the run did not learn ({plain})"  # from ln(256) = 5.5
    assert abs(quangrad - plain) <= 0.02 * plain, f"seed {seed}: plain {plain}, quangrad {quangrad}"
    assert quangrad != plain  # the 8-bit path really ran (the buckets are above the plain fallback size)


@needs_triton
@pytest.mark.parametrize("block", [32, 256])
def test_fused_accumulate_kernel_matches_reference(block):
    """The fused dequantize-add-requantize kernel (interpreter on CPU) leaves exactly the reference's
    bytes: Gaussian, zero, subnormal-scale and non-finite blocks, a gradient ending mid-block."""
    from agoq.runtime.comm.quangrad import accumulate_reference
    from agoq.runtime.comm.quangrad_triton import accumulate_triton
    from agoq.runtime.quant.codec import quantize

    nb = 13
    n = nb * block - block // 2 - 3
    start = torch.randn(nb * block) * 3
    start[block:2 * block] = 0
    start[2 * block:3 * block] *= 1e-40  # subnormal scales: the lifted path
    q = quantize(start, 8, block, backend="torch")
    for grad in (torch.randn(n), torch.randn(n).to(torch.bfloat16), torch.where(torch.arange(n) == 5 * block + 1,
                                                                                float("inf"), torch.randn(n))):
        got_c, got_s = q.data.clone(), q.scales.clone()
        want_c, want_s = q.data.clone(), q.scales.clone()
        accumulate_triton(got_c, got_s, grad, block)
        accumulate_reference(want_c, want_s, grad, block)
        assert torch.equal(got_c, want_c)
        assert torch.equal(got_s.nan_to_num(-1.0), want_s.nan_to_num(-1.0))
    # and against float64: the stored gradient is the sum within one int8 step per block
    c, s = q.data.clone(), q.scales.clone()
    g = torch.randn(n, dtype=torch.float64)
    accumulate_triton(c, s, g.float(), block)
    want = (q.data.double() - 127) * q.scales.double().repeat_interleave(block)
    want[:n] += g
    got = (c.double() - 127) * s.double().repeat_interleave(block)
    step = s.double().repeat_interleave(block)
    # half an int8 step, plus float32's own roundings on the way: the gradient's cast, the float32 sum, and
    # the scale's reciprocal that the codes are rounded with (a few ulps of 127 steps)
    bound = 0.5 * step * (1 + 2**-14) + (want.abs() + got.abs()) * 2**-22 + 1e-12
    excess = ((got - want).abs() - bound).max().item()
    assert excess <= 0, f"worst excess over the bound: {excess:.3g}"
