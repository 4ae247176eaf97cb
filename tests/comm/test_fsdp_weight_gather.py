"""FSDP2's weight all-gather in int8 / int4 (agoq.comm.fsdp_weight_gather) over gloo: the weight forward and
backward compute with against a float64 block quantize -> dequantize of FSDP2's shards written here, and
within the block absmax bound; gradients against a model run at the same dequantized weights; a few training
steps against FSDP2's own gather. World sizes 2, 3 and 4, with sizes that do not divide evenly."""

import math

import pytest
import torch
from torch import nn

from agoq.models import build
from agoq.models.lm_loss import chunked_lm_loss
from tests.multiprocess import run_workers

BLOCK = 32
# (rows, cols): 53 rows split 27/26 over 2, 18/18/17 over 3, 14/14/14/11 over 4; 5 rows over 4: 2/2/1/0
SHAPES = ((53, 37), (11, 53), (5, 7))
CFG = dict(vocab_size=97, hidden_size=48, intermediate_size=136, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)
SEQ, BATCH, STEPS, LR = 11, 2, 4, 0.01
TIE = 1e-4  # |x / s| this close to a rounding tie may round either way in float32: one level either way


def _hadamard64():
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(5):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # Sylvester
    return h / math.sqrt(32)


def _reference(w, world, bits, block, hadamard):
    """float64: FSDP2's shards of `w` (ceil(R / world) rows each, zero-padded and flattened, then padded to whole
    blocks), each block quantized to floor(x / s + 1/2) with s = absmax / qmax and dequantized. Per value of `w`:
    (the dequantized weight, its block's s, the error a near-tie code may add (one level s, spread over its
    32-group by the Hadamard transform), its 32-group's index)."""
    qmax = 2 ** (bits - 1) - 1
    rows = -(-w.shape[0] // world)
    n = rows * w[0].numel()
    padded = -(-n // block) * block
    outs, scales, slack, groups = [], [], [], []
    for r in range(world):
        shard = w[r * rows:(r + 1) * rows].double().reshape(-1)
        x = torch.zeros(padded, dtype=torch.float64)
        x[:shard.numel()] = shard
        if hadamard:
            x = (x.view(-1, 32) @ _hadamard64()).reshape(-1)
        xb = x.view(-1, block)
        s = xb.abs().amax(1, keepdim=True) / qmax
        v = torch.where(s > 0, xb / s, torch.zeros_like(xb))
        deq = (torch.floor(v + 0.5).clamp(-qmax, qmax) * s).reshape(-1)
        near = (((v - torch.floor(v)) - 0.5).abs() < TIE).double().reshape(-1)
        s = s.expand(-1, block).reshape(-1)
        if hadamard:
            deq = (deq.view(-1, 32) @ _hadamard64()).reshape(-1)
            near = near.view(-1, 32).sum(1, keepdim=True).expand(-1, 32).reshape(-1) / math.sqrt(32)
        k = shard.numel()
        outs.append(deq[:k]), scales.append(s[:k]), slack.append(near[:k] * s[:k])
        groups.append(r * padded // 32 + torch.arange(k) // 32)
    shape = w.shape
    return (torch.cat(outs).view(shape), torch.cat(scales).view(shape), torch.cat(slack).view(shape),
            torch.cat(groups).view(shape))


def _check_gathered(got, w, bits, world, hadamard, dtype):
    """`got` (the weight FSDP2 computed with) against the reference of `w` and the block bound."""
    ref, s, slack, groups = _reference(w, world, bits, BLOCK, hadamard)
    got, w = got.double(), w.double()
    qmax = 2 ** (bits - 1) - 1
    tol = 1e-5 * s * qmax + slack  # float32 arithmetic, relative to the block's absmax; near-tie codes
    if dtype == torch.bfloat16:
        tol = tol + 2.0**-7 * ref.abs()  # one bf16 ulp
    assert ((got - ref).abs() <= tol).all(), float(((got - ref).abs() - tol).max())
    err = got - w
    rounding = 2.0**-8 * got.abs() if dtype == torch.bfloat16 else 0.0
    if hadamard:  # per 32-group, in L2: the orthonormal inverse keeps the transformed error's norm
        sq = torch.zeros(int(groups.max()) + 1, dtype=torch.float64).index_add_(0, groups.view(-1),
                                                                                  err.view(-1).square())
        smax = torch.zeros_like(sq)
        smax[groups.view(-1)] = s.view(-1)  # a 32-group lies in one block: one scale
        extra = torch.zeros_like(sq).index_add_(0, groups.view(-1), (1e-5 * s * qmax + rounding).view(-1) ** 2)
        assert (sq.sqrt() <= math.sqrt(32) * smax / 2 * (1 + 1e-6) + extra.sqrt()).all()
    else:
        assert (err.abs() <= s / 2 * (1 + 1e-6) + 1e-5 * s * qmax + rounding).all()
    assert err.abs().max() > 0  # quantized, not FSDP2's exact gather


class _Capture(torch.autograd.Function):
    """x @ w.T, recording w as forward reads it and as backward reads it again (FSDP2 frees the unsharded weight
    after forward and gathers it into the same tensor before backward)."""

    @staticmethod
    def forward(ctx, x, w, seen, index):
        ctx.save_for_backward(x, w)
        ctx.seen, ctx.index = seen, index
        seen["forward"][index] = w.detach().clone()
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.seen["backward"][ctx.index] = w.detach().clone()
        return g @ w, g.t() @ x, None, None


class _Probe(nn.Module):
    def __init__(self, rows, cols, index, seen):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, cols))
        self.index, self.seen = index, seen

    def forward(self, x):
        return _Capture.apply(x, self.weight, self.seen, self.index)


class _Probes(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.probes = nn.ModuleList(_Probe(r, c, i, seen) for i, (r, c) in enumerate(SHAPES))

    def forward(self, xs):
        return sum(p(x).float().square().sum() for p, x in zip(self.probes, xs))


CONFIGS = ((8, torch.float32), (8, torch.bfloat16), (4, torch.float32))  # (bits, param_dtype)


def _gather_worker(rank, world, seed):
    """Per (bits, param_dtype) of CONFIGS: the weights one forward and backward computed with under FSDP2 (each
    probe its own unit, resharded after forward), the float32 weights they came from, the pre-all-gather hook's
    calls."""
    return [_gather_once(world, bits, dtype, seed) for bits, dtype in CONFIGS]


def _gather_once(world, bits, param_dtype, seed):
    from agoq.comm import fsdp_weight_gather as wg

    calls = [0]
    original = wg.QuantizedGatherWeight.fsdp_pre_all_gather

    def counted(self, mesh):
        calls[0] += 1
        return original(self, mesh)

    wg.QuantizedGatherWeight.fsdp_pre_all_gather = counted
    try:
        return _probe_run(world, bits, param_dtype, seed), calls[0]
    finally:
        wg.QuantizedGatherWeight.fsdp_pre_all_gather = original


def _probe_run(world, bits, param_dtype, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from agoq.comm import fsdp_weight_gather as wg

    torch.manual_seed(seed)
    seen = {"forward": {}, "backward": {}}
    model = _Probes(seen)
    with torch.no_grad():
        model.probes[0].weight[3, :20] = 0.0  # zeros across a block boundary
        model.probes[1].weight[2, 5] = 40.0  # an outlier
    full = [p.weight.detach().clone() for p in model.probes]
    assert wg.apply_weight_gather(model, bits=bits, block=BLOCK) == len(SHAPES)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    for p in model.probes:
        fully_shard(p, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model([torch.randn(3, c, dtype=param_dtype) for _, c in SHAPES]).backward()
    return full, seen


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gathered_weight_is_the_block_quantized_weight_in_forward_and_backward(world, seed):
    by_rank = run_workers(_gather_worker, world, seed)
    for c, (bits, dtype) in enumerate(CONFIGS):
        results = [r[c] for r in by_rank]
        for (full, seen), calls in results:
            assert calls == 2 * len(SHAPES)  # forward, and backward's re-gather
            for i, w in enumerate(full):
                assert seen["forward"][i].dtype == dtype
                assert torch.equal(seen["forward"][i], seen["backward"][i])
                assert torch.equal(seen["forward"][i], results[0][0][1]["forward"][i])  # every rank the same
                _check_gathered(seen["forward"][i], w, bits, world, bits == 4, dtype)
