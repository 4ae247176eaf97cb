"""HSDP (FSDP2 over replicate x shard) over gloo: FSDP2's native HSDP against one process, the replicas' 8-bit
(QuanGrad) and 4-bit (TLq) all-reduces within their derived error bounds, replicas identical."""

import math

import torch

from agoq.models import build
from tests.multiprocess import run_workers
from tests.runtime.comm.test_fsdp import CFG, LR, STEPS, _Loss, _batch, _check_replicas, _norm, _reference_grads
from tests.runtime.comm.test_fsdp import _single_process

# QuanGrad: nearest rounding to int8, one scale per 256 values, twice (each rank's input, then the sum): a value
# moves by at most half a step, absmax / 127 / 2, per rounding, so per 256-block the error's L2 norm is below
# sqrt(256) / 254 x (sum over ranks of the block's norm + the sum's), and over blocks (Minkowski) below
# sqrt(256) / 254 x (sum_r ||x_r|| + ||sum_r x_r||)
QUANGRAD8 = math.sqrt(256) / 254
# TLq-HS within a node: stochastic int8, one scale per 128 values: below one step absmax / 127 per value
INT8 = math.sqrt(128) / 127
# TLq's 4-bit all-reduce: stochastic int4 (levels -7..7) per 128 values, each rank's input and the sum
INT4 = math.sqrt(128) / 7


def _train_worker(rank, world, replicate, reduce_scatter, all_reduce, seed):
    """STEPS of SGD under HSDP (replicate x world / replicate); per step the gathered parameters and gradient."""
    from agoq.runtime.comm.fsdp import fully_shard_quantized
    from agoq.runtime.comm.hsdp import hybrid_mesh

    mesh = hybrid_mesh("cpu", replicate, world // replicate)
    root = fully_shard_quantized(_Loss(build(CFG, dtype=torch.float32, seed=seed)), mesh=mesh,
                                 reduce_scatter=reduce_scatter, all_reduce=all_reduce, seed=seed + 7)
    opt = torch.optim.SGD(root.parameters(), lr=LR, momentum=0.9)
    ids, labels = _batch(seed, rank)
    steps = []
    for _ in range(STEPS):
        params = {n: p.full_tensor().clone() for n, p in root.named_parameters()}
        root(ids, labels).backward()
        steps.append((params, {n: p.grad.full_tensor().clone() for n, p in root.named_parameters()}))
        opt.step()
        opt.zero_grad()
    placements = {str(p.placements) for p in root.parameters()}
    return steps, {n: p.full_tensor() for n, p in root.named_parameters()}, placements


def _errors(results, world, replicate, seed):
    """Per step: (the error of the gradient against the float64 mean, the ranks' gradients, the nodes' sums)."""
    shard = world // replicate
    out = []
    for params, grads in results[0][0]:
        per_rank = _reference_grads(params, world, seed)
        exact = {n: sum(g[n] for g in per_rank) / world for n in grads}
        error = _norm({n: grads[n].double() - exact[n] for n in grads})
        nodes = [{n: sum(g[n] for g in per_rank[r * shard:(r + 1) * shard]) for n in grads} for r in range(replicate)]
        out.append((error, per_rank, nodes, exact))
    return out


def test_native_hsdp_matches_one_process_and_replicas_agree(seed):
    world, replicate = 4, 2
    results = run_workers(_train_worker, world, replicate, "exact", "exact", seed)
    _check_replicas([r[:2] for r in results])
    assert results[0][2] == {"(Replicate(), Shard(dim=0))"}  # FSDP2's own HSDP
    ref = _single_process(world, seed)
    for n, p in results[0][1].items():
        torch.testing.assert_close(p, ref[n].detach(), rtol=1e-5, atol=1e-6)


def test_quangrad8_all_reduce_of_the_replicas_within_its_bound(seed):
    world, replicate = 4, 2
    results = run_workers(_train_worker, world, replicate, "exact", "quangrad8", seed)
    _check_replicas([r[:2] for r in results])
    assert results[0][2] == {"(Shard(dim=0),)"}  # sharded over the node's row, the replicas through the hook
    for error, _, nodes, _ in _errors(results, world, replicate, seed):
        means = [{n: v / (world // replicate) for n, v in node.items()} for node in nodes]
        total = {n: sum(m[n] for m in means) for n in means[0]}
        bound = QUANGRAD8 * (sum(_norm(m) for m in means) + _norm(total)) / replicate
        assert 0.01 * bound < error <= bound, (error, bound)  # quantized (an exact reduction: ~1e-5 x bound)


def test_tlq_hs_in_the_node_and_int4_across_within_their_bound(seed):
    """3 nodes of 2 ranks (a world that is not a power of two): TLq-HS int8 within each node, the 4-bit all-reduce
    across the 3 replicas."""
    world, replicate = 6, 3
    results = run_workers(_train_worker, world, replicate, "tlq-hs", "tlq4", seed)
    _check_replicas([r[:2] for r in results])
    for error, per_rank, nodes, exact in _errors(results, world, replicate, seed):
        total = {n: v * world for n, v in exact.items()}
        # the 4-bit stage's inputs are the nodes' int8 sums: their norms exceed the exact ones by at most the int8
        # error, which the first term bounds
        int8 = INT8 * sum(_norm(g) for g in per_rank)
        bound = (int8 + INT4 * (sum(_norm(x) for x in nodes) + _norm(total) + replicate * int8)) / world
        assert 0.01 * bound < error <= bound, (error, bound)  # quantized (an exact reduction: ~1e-5 x bound)
        assert error < 0.5 * bound  # stochastic rounding: far from every value's worst case
