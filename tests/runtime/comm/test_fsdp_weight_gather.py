"""FSDP2's weight all-gather in int8 / int4 (agoq.runtime.comm.fsdp_weight_gather) over gloo: the weight forward and
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


def _check_gathered(got, w, bits, world, hadamard, dtype, block=BLOCK):
    """`got` (the weight FSDP2 computed with) against the reference of `w` and the block bound."""
    ref, s, slack, groups = _reference(w, world, bits, block, hadamard)
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
    from agoq.runtime.comm import fsdp_weight_gather as wg

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

    from agoq.runtime.comm import fsdp_weight_gather as wg

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


# ------------------------------------------------------------------------------------------ training


class _Loss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return chunked_lm_loss(self.model.model(ids), self.model.lm_head.weight, labels)


def _batch(seed, rank, step):
    g = torch.Generator().manual_seed(seed * 1009 + rank * 31 + step)
    ids = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _strategy(rank, world, weight_gather, seed):
    from agoq.parallel_dims import ParallelDims
    from agoq.train.apply import apply_parallel
    from agoq.train.config import OptimizerConfig
    from agoq.train.data import BatchShape
    from agoq.train.parallel import World

    strategy = apply_parallel(build(CFG, dtype=torch.float32, seed=seed), dims=ParallelDims.of_mode("fsdp", world),
                              world=World(rank, world, backend="gloo"), device=torch.device("cpu"), gradients="bf16",
                              dtype=torch.float32, shape=BatchShape(SEQ, BATCH, 1), weight_gather=weight_gather)
    return strategy, strategy.build_optimizer(OptimizerConfig(lr=LR, weight_decay=0.0), seed=0)


def _unsharded(module):
    """The parameters of every FSDP2 unit of `module` as FSDP2 gathers them (what forward computes with)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    for m in units:
        m.reshard()
    return params


def _train_worker(rank, world, weight_gather, seed, folder=None):
    """STEPS of `agoq train`'s fsdp strategy (AdamW on float32 shards): per step this rank's loss, the float32
    parameters before the step (and as the all-gather gives them) and their averaged gradient, gathered whole;
    how many weight matrices were wrapped; with
    `folder`, whether a checkpoint saved there loads into another run as the same parameters and loss."""
    import torch.distributed as dist

    from agoq.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint

    strategy, step = _strategy(rank, world, weight_gather, seed)
    names = [n for n, _ in strategy.loss_module.named_parameters()]
    wrapped = sum(type(p.to_local()).__name__ == "QuantizedGatherWeight" for p in strategy.params)
    def storages():
        from agoq.runtime.comm.fsdp_weight_gather import unwrap

        return [unwrap(p).untyped_storage().data_ptr() for p in strategy.params]

    before = storages()  # the local tensors an optimizer built now holds (adamw8bit captures them)
    out = []
    for k in range(STEPS):
        params = {n: p.full_tensor().clone() for n, p in zip(names, strategy.loss_module.parameters())}
        params = (params, _unsharded(strategy.loss_module))
        strategy.zero_grad()
        loss = strategy.loss_module(*_batch(seed, rank, k))
        loss.backward()
        grads = strategy.gradients(fused=False)
        out.append((float(loss.detach()), params, {n: g.full_tensor().clone() for n, g in zip(names, grads)}))
        step.step(grads, 1.0)
    # FSDP2's lazy initialisation (re-padding a subclass's uneven shard) ran before the optimizer was built
    assert storages() == before
    if folder is None:
        return out, wrapped, None
    save_checkpoint(folder, STEPS, step.checkpoint_state(strategy.module), {}, rank=rank, world=world,
                    barrier=dist.barrier)
    other, other_step = _strategy(rank, world, weight_gather, seed + 1)
    state = other_step.checkpoint_state(other.module)
    load_checkpoint(find_checkpoint(folder)[0], state)
    other_step.restore(other.module, state)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(strategy.params, other.params))
    still = sum(type(p.to_local()).__name__ == "QuantizedGatherWeight" for p in other.params)
    batch = _batch(seed, rank, STEPS)
    losses = float(strategy.loss_module(*batch).detach()), float(other.loss_module(*batch).detach())
    return out, wrapped, (same, still, losses)


def _reference_grad(params, world, seed, step):
    """float64: the gradient averaged over the ranks' batches at `params`."""
    model = _Loss(build(CFG, dtype=torch.float64, seed=seed))
    missing, unexpected = model.load_state_dict({n: p.double() for n, p in params.items()}, strict=False)
    assert not unexpected and not any(k in dict(model.named_parameters()) for k in missing)
    for r in range(world):
        model(*_batch(seed, r, step)).backward()
    return {n: p.grad / world for n, p in model.named_parameters()}


BLOCK_TRAIN = 256  # agoq train's block (DEFAULT_BLOCK)


def _rel(a, b):
    return math.sqrt(sum(float((a[n].double() - b[n]).square().sum()) for n in b)
                     / sum(float(b[n].square().sum()) for n in b))


@pytest.mark.parametrize("world", [3])
def test_int8_gather_trains_like_bf16_and_its_gradient_is_the_dequantized_weights(world, seed, tmp_path):
    exact = run_workers(_train_worker, world, "bf16", seed)
    int8 = run_workers(_train_worker, world, "int8", seed, str(tmp_path))
    assert exact[0][1] == 0 and int8[0][1] == sum(p.dim() >= 2 for p in build(CFG, seed=seed).parameters())
    for _, wrapped, (same, still, (loss, reloaded)) in int8:  # a checkpoint holds the parameters, not the wrappers
        assert same and still == wrapped and loss == reloaded
    for k in range(STEPS):
        losses = [r[0][k][0] for r in int8]
        ref_losses = [r[0][k][0] for r in exact]
        mean, ref = sum(losses) / world, sum(ref_losses) / world
        assert math.isfinite(mean) and abs(mean - ref) <= 1e-2 * ref, (k, mean, ref)
        _, (params, gathered), grads = int8[0][0][k]
        for n, w in params.items():  # what forward computes with: the block quantized weights, exact vectors
            if w.dim() >= 2:
                _check_gathered(gathered[n], w, 8, world, False, torch.float32, BLOCK_TRAIN)
            else:
                assert torch.equal(gathered[n], w)
        error = _rel(grads, _reference_grad(gathered, world, seed, k))
        assert error <= 1e-5, (k, error)
        # the check can fail: the gradient at the unquantized weights is far from the one measured
        assert _rel(grads, _reference_grad(params, world, seed, k)) > 100 * max(error, 1e-7)
