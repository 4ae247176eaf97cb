"""FSDP2 with agoq's collectives over gloo: exact FSDP2 against one process, TLq-HS within its derived error
bound, replicas identical, and the clip norm of the sharded modes against the norm of the averaged gradient."""

import math

import torch
import torch.distributed as dist
from torch import nn

from agoq.models import build
from agoq.models.lm_loss import chunked_lm_loss
from tests.multiprocess import run_workers

# non-round sizes: FSDP2 pads dim 0 (97 rows over 3 ranks), TLq-HS pads each row to whole 128-groups
CFG = dict(vocab_size=97, hidden_size=48, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)
SEQ, BATCH, STEPS, LR = 11, 2, 3, 0.05
# int8 with one scale per 128 values: each value moves by less than one step max|block| / 127, so one rank's
# error has L2 norm < sqrt(128) / 127 * ||its transformed gradient|| = sqrt(128) / 127 * ||g_r|| (orthonormal)
INT8_BOUND = math.sqrt(128) / 127


class _Loss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return chunked_lm_loss(self.model.model(ids), self.model.lm_head.weight, labels)


def _batch(seed, rank):
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _train_worker(rank, world, reduce_scatter, seed):
    """STEPS of SGD under FSDP2; per step the gathered parameters before it and the gathered gradient."""
    from agoq.runtime.comm.fsdp import fully_shard_quantized

    root = fully_shard_quantized(_Loss(build(CFG, dtype=torch.float32, seed=seed)), mesh=_mesh(world),
                                 reduce_scatter=reduce_scatter, seed=seed + 7)
    opt = torch.optim.SGD(root.parameters(), lr=LR, momentum=0.9)
    ids, labels = _batch(seed, rank)
    steps = []
    for _ in range(STEPS):
        params = {n: p.full_tensor().clone() for n, p in root.named_parameters()}
        root(ids, labels).backward()
        steps.append((params, {n: p.grad.full_tensor().clone() for n, p in root.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return steps, {n: p.full_tensor() for n, p in root.named_parameters()}


def _reference_grads(params, world, seed):
    """Per rank, the float64 gradient of its batch's loss at `params` (names as in the FSDP root)."""
    model = _Loss(build(CFG, dtype=torch.float64, seed=seed))
    missing, unexpected = model.load_state_dict({k: v.double() for k, v in params.items()}, strict=False)
    assert not unexpected and not any(k in dict(model.named_parameters()) for k in missing)
    out = []
    for r in range(world):
        model.zero_grad()
        model(*_batch(seed, r)).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def _norm(d):
    return math.sqrt(sum(float(v.double().square().sum()) for v in d.values()))


def _single_process(world, seed):
    """The same SGD run in one process, on the mean of the ranks' losses."""
    model = _Loss(build(CFG, dtype=torch.float32, seed=seed))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _ in range(STEPS):
        loss = sum(model(*_batch(seed, r)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def _check_replicas(results):
    finals = [final for _, final in results]
    for other in finals[1:]:
        assert all(torch.equal(finals[0][n], other[n]) for n in finals[0])
    for step in range(STEPS):
        for _, grads in (r[0][step] for r in results[1:]):
            assert all(torch.equal(grads[n], results[0][0][step][1][n]) for n in grads)


def test_exact_fsdp2_matches_one_process_and_replicas_agree(seed):
    world = 3
    results = run_workers(_train_worker, world, "exact", seed)
    _check_replicas(results)
    ref = _single_process(world, seed)
    for n, p in results[0][1].items():
        torch.testing.assert_close(p, ref[n].detach(), rtol=1e-5, atol=1e-6)


def test_tlq_hs_reduce_scatter_within_its_int8_bound_every_step(seed):
    world = 3
    results = run_workers(_train_worker, world, "tlq-hs", seed)
    _check_replicas(results)
    for params, grads in results[0][0]:
        per_rank = _reference_grads(params, world, seed)
        exact = {n: sum(g[n] for g in per_rank) / world for n in grads}
        error = _norm({n: grads[n].double() - exact[n] for n in grads})
        # FSDP2 divides the TLq-HS sum by the world size after the reduce-scatter
        bound = INT8_BOUND * sum(_norm(g) for g in per_rank) / world
        assert 0 < error <= bound, (error, bound)
        assert error < 0.5 * bound  # stochastic rounding: far from every value's worst case


def test_reduce_scatter_sums_or_averages_and_refuses_other_ops():
    outs = run_workers(_ops_worker, 2)
    # rows of 130 values (two 128-groups after padding); the sum of rank r's rows is 1 + 2 = 3 times row r
    want = torch.arange(260, dtype=torch.float32).view(2, 130) / 100
    for rank, (total, mean) in enumerate(outs):
        torch.testing.assert_close(total, 3 * want[rank], rtol=0.02, atol=0.02 * float(want.abs().max()))
        torch.testing.assert_close(mean, 1.5 * want[rank], rtol=0.02, atol=0.01 * float(want.abs().max()))


def _ops_worker(rank, world):
    import pytest

    from agoq.runtime.comm.fsdp_collectives import TLQHSReduceScatter

    comm = TLQHSReduceScatter()
    data = torch.arange(260, dtype=torch.float32) / 100 * (rank + 1)
    total, mean = comm.allocate((130,), dtype=torch.float32, device=torch.device("cpu")), torch.empty(130)
    comm(total, data, dist.group.WORLD, dist.ReduceOp.SUM)
    comm(mean, data, dist.group.WORLD, dist.ReduceOp.AVG)
    with pytest.raises(ValueError, match="set_force_sum_reduction_for_comms"):
        comm(mean, data, dist.group.WORLD, dist.ReduceOp.PREMUL_SUM(0.5))
    return total, mean


# ------------------------------------------------------------------------------------------ clip norm


def _strategy_norm_worker(rank, world, mode, gradients, seed):
    """The clip norm `agoq train` computes in `mode` (hsdp: nodes of one rank) after one backward of this rank's
    batch."""
    from agoq.parallel_dims import ParallelDims
    from agoq.train.apply import apply_parallel
    from agoq.train.config import OptimizerConfig
    from agoq.train.data import BatchShape
    from agoq.train.parallel import World, _model_loss

    model = build(CFG, dtype=torch.float32, seed=seed)
    dims = ParallelDims.of_mode(mode, world, ranks_per_node=1 if mode == "hsdp" else None)
    strategy = apply_parallel(model, dims=dims, world=World(rank, world, backend="gloo"), device=torch.device("cpu"),
                              gradients=gradients, dtype=torch.float32, shape=BatchShape(SEQ, BATCH, 1))
    step = strategy.build_optimizer(OptimizerConfig(), seed=0)
    ids, labels = _batch(seed, rank)
    loss = strategy.loss_module(ids, labels) if mode in ("fsdp", "hsdp") else _model_loss(strategy.module, ids, labels)
    loss.backward()
    return strategy.grad_norm(strategy.gradients(fused=step.fused), fused=step.fused)


def test_clip_norm_is_the_norm_of_the_averaged_gradient(seed):
    world = 3
    params = {f"model.{k}": v for k, v in build(CFG, dtype=torch.float32, seed=seed).state_dict().items()}
    per_rank = _reference_grads(params, world, seed)
    names = per_rank[0].keys()
    exact = _norm({n: sum(g[n] for g in per_rank) / world for n in names})
    rms_of_local = math.sqrt(sum(_norm(g) ** 2 for g in per_rank) / world)
    assert abs(rms_of_local - exact) > 0.05 * exact  # the old formula would fail below
    for mode, gradients in (("fsdp", "bf16"), ("hsdp", "bf16")):  # hsdp: 3 replicas of 1 shard
        norms = run_workers(_strategy_norm_worker, world, mode, gradients, seed)
        assert all(n == norms[0] for n in norms)
        assert abs(norms[0] - exact) <= 1e-5 * exact, (mode, norms[0], exact)
    # quantized: |norm(q) - norm(exact)| <= norm(q - exact) <= the int8 bound (triangle inequality)
    bound = INT8_BOUND * sum(_norm(g) for g in per_rank) / world
    for mode in ("fsdp",):
        norms = run_workers(_strategy_norm_worker, world, mode, "sdp4bit", seed)
        assert all(n == norms[0] for n in norms)
        assert abs(norms[0] - exact) <= bound, (mode, norms[0], exact, bound)
