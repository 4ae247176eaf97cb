"""QuanGrad: the 8-bit gradient buffer and the DDP hook, against exact gradients."""

import os

import torch
import torch.distributed as dist
from torch import nn

from agoq.runtime.quangrad import QuantizedGradients, quangrad_hook
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


def test_buffer_accumulates_micro_batches_and_saves_memory():
    seed = int.from_bytes(os.urandom(3), "little")
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
    dist.barrier()
    return grads_hook, grads_buffer


def test_ddp_hook_and_buffer_all_reduce():
    seed = int.from_bytes(os.urandom(3), "little")
    world = 3
    results = run_workers(_ddp_worker, world, seed)
    ref = _model(seed).double()
    for r in range(world):
        x, y = _batch(seed, r, 0)
        (nn.functional.mse_loss(ref(x.double()), y.double()) / world).backward()
    exact = [p.grad for p in ref.parameters()]
    for which in (0, 1):
        got = results[0][which]
        for r in range(world):
            assert all(torch.equal(a, b) for a, b in zip(results[r][which], got)), f"seed {seed} rank {r} differs"
        num = sum(((g.double() - e) ** 2).sum() for g, e in zip(got, exact))
        den = sum((e ** 2).sum() for e in exact)
        assert (num / den).sqrt() < DDP_REL_ERR_BOUND, f"seed {seed} path {which}"
