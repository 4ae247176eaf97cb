"""The wire format of FSDP2's quantized weight all-gather (agoq.runtime.comm.weight_gather_codec): the torch
reference against a float64 closed form written here, and the fused Triton kernels (agoq.runtime.comm.
weight_gather_triton; on the GPU, or in Triton's interpreter) against the torch reference. Fresh random weights
of sizes that do not divide evenly, worlds 2, 3 and 4, one rank with no rows."""

import math

import pytest
import torch

from agoq.runtime.comm.weight_gather_codec import (dequantize_gather_reference, quantize_shard_reference,
                                                   wire_layout)
from tests.backends import DEVICE, needs_triton

SHAPES = ((53, 37), (11, 53), (5, 7))  # 5 rows over 4 ranks: 2/2/1/0
CASES = ((8, 32, False), (8, 64, False), (4, 32, True), (4, 64, False))  # (bits, block, hadamard)
TIE = 1e-4  # |x / s| this close to a rounding tie may round either way in float32


def _sylvester64():
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(5):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(32)


def _shards(w, world):
    rows = -(-w.shape[0] // world)
    return [w[r * rows:(r + 1) * rows] for r in range(world)]


def _closed_form(w, world, bits, block, hadamard):
    """float64: per value of `w`, the dequantized weight of FSDP2's zero-padded shards quantized block by block
    (q = floor(x / s + 1/2), s = absmax / qmax), the slack a near-tie code may add, and the block scale s."""
    qmax = 2 ** (bits - 1) - 1
    rows = -(-w.shape[0] // world)
    n = rows * w[0].numel()
    padded = -(-n // block) * block
    outs, slacks, scales = [], [], []
    for shard in _shards(w, world):
        x = torch.zeros(padded, dtype=torch.float64)
        x[:shard.numel()] = shard.double().reshape(-1)
        if hadamard:
            x = (x.view(-1, 32) @ _sylvester64()).reshape(-1)
        xb = x.view(-1, block)
        s = xb.abs().amax(1, keepdim=True) / qmax
        v = torch.where(s > 0, xb / s, torch.zeros_like(xb))
        deq = (torch.floor(v + 0.5).clamp(-qmax, qmax) * s).reshape(-1)
        near = (((v - torch.floor(v)) - 0.5).abs() < TIE).double().reshape(-1)
        s = s.expand(-1, block).reshape(-1)
        if hadamard:  # a near-tie code's error of one level spreads over its 32-group
            deq = (deq.view(-1, 32) @ _sylvester64()).reshape(-1)
            near = near.view(-1, 32).sum(1, keepdim=True).expand(-1, 32).reshape(-1) / math.sqrt(32)
        k = shard.numel()
        outs.append(deq[:k]), slacks.append(near[:k] * s[:k]), scales.append(s[:k])
    return torch.cat(outs), torch.cat(slacks), torch.cat(scales)


def _gather(w, world, bits, block, hadamard, quantize, dequantize, dtype):
    lay = wire_layout(bits, block, hadamard, tuple(w.shape), world)
    inputs = [quantize(shard, lay) for shard in _shards(w, world)]
    assert all(t.dtype == torch.uint8 and t.numel() == lay.nbytes for t in inputs)
    out = torch.full((lay.total,), float("nan"), dtype=dtype, device=w.device)
    dequantize(torch.cat(inputs), lay, world, out)
    return inputs, out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_closed_form(world, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    for bits, block, hadamard in CASES:
        for shape in SHAPES:
            w = torch.randn(shape, generator=g) * 10.0 ** float(torch.empty(1).uniform_(-3, 2, generator=g))
            w.view(-1)[int(torch.randint(w.numel(), (1,), generator=g))] *= 50.0  # an outlier
            _, got = _gather(w, world, bits, block, hadamard, quantize_shard_reference,
                             dequantize_gather_reference, dtype)
            ref, slack, s = _closed_form(w, world, bits, block, hadamard)
            tol = 1e-5 * s * (2 ** (bits - 1) - 1) + slack  # float32 arithmetic, relative to the block's absmax
            if dtype == torch.bfloat16:
                tol = tol + 2.0**-8 * ref.abs()  # rounded once to bf16
            err = (got.double() - ref).abs()
            assert (err <= tol).all(), (bits, block, hadamard, shape, float((err - tol).max()))
            assert (got.double() - w.double().reshape(-1)).abs().max() > 0  # quantized indeed


def test_a_block_holding_nan_or_inf_dequantizes_to_nan(seed):
    g = torch.Generator().manual_seed(seed)
    for bits, block, hadamard in CASES:
        w = torch.randn(9, 40, generator=g)
        w[1, 3], w[6, 0] = float("nan"), float("inf")
        _, got = _gather(w, 2, bits, block, hadamard, quantize_shard_reference, dequantize_gather_reference,
                         torch.float32)
        lay = wire_layout(bits, block, hadamard, (9, 40), 2)
        rank_block = torch.arange(lay.total) // lay.numel * lay.nblocks + torch.arange(lay.total) % lay.numel // block
        bad = torch.zeros(2 * lay.nblocks, dtype=torch.bool)
        bad[rank_block[torch.tensor([1 * 40 + 3, 6 * 40])]] = True
        assert torch.equal(got.isnan(), bad[rank_block]), (bits, block)


@needs_triton
@pytest.mark.parametrize("world", [2, 3, 4])
def test_triton_kernels_match_the_reference(world, seed):
    from agoq.runtime.comm.weight_gather_triton import dequantize_gather_triton, quantize_shard_triton

    g = torch.Generator().manual_seed(seed)
    for bits, block, hadamard in CASES:
        for shape, dtype in zip(SHAPES, (torch.float32, torch.bfloat16, torch.float32)):
            w = (torch.randn(shape, generator=g) * 3).to(DEVICE)
            ref_in, ref = _gather(w.cpu(), world, bits, block, hadamard, quantize_shard_reference,
                                  dequantize_gather_reference, torch.float32)
            got_in, got = _gather(w, world, bits, block, hadamard, quantize_shard_triton, dequantize_gather_triton,
                                  dtype)
            lay = wire_layout(bits, block, hadamard, shape, world)
            for a, b in zip(ref_in, got_in):
                b = b.cpu()
                if not hadamard:  # the same float32 operations: the same codes and scales, bit for bit
                    assert torch.equal(a, b)
                else:  # the Hadamard product may sum in another order: scales an ulp, a code a level off at a tie
                    sa, sb = a[lay.code_bytes:].view(torch.float32), b[lay.code_bytes:].view(torch.float32)
                    assert ((sa - sb).abs() <= 1e-6 * sa.abs()).all()
                    diff = (a[:lay.code_bytes].view(-1, 1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 15
                    diff_b = (b[:lay.code_bytes].view(-1, 1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 15
                    assert (diff.int() - diff_b.int()).abs().max() <= 1
            # dequantized from the reference's bytes: the same values, rounded once to `dtype`
            out = torch.empty(lay.total, dtype=dtype, device=DEVICE)
            dequantize_gather_triton(torch.cat(ref_in).to(DEVICE), lay, world, out)
            ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0  # one bf16 ulp; float32 sums of the Hadamard product
            tol = ulp * ref.abs().double() + 1e-6 * float(ref.abs().max())
            assert ((out.cpu().double() - ref.double()).abs() <= tol).all()
            assert got.isfinite().all()


class _Mesh:
    def __init__(self, world):
        self.world = world

    def size(self):
        return self.world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_hooks_write_the_closed_form_into_fsdps_parameter_and_free_the_gathered_bytes(world, seed):
    from agoq.runtime.comm.fsdp_weight_gather import GatherSpec, QuantizedGatherWeight

    g = torch.Generator().manual_seed(seed)
    for bits, block, hadamard in CASES:
        w = torch.randn(53, 37, generator=g)
        spec = GatherSpec(bits, block, hadamard, tuple(w.shape))
        inputs = []
        for shard in _shards(w, world):  # each rank's hook, on its own shard
            (buf,), meta = QuantizedGatherWeight(shard.clone(), spec).fsdp_pre_all_gather(_Mesh(world))
            assert meta == world and buf.dtype == torch.uint8
            inputs.append(buf)
        hook = QuantizedGatherWeight(_shards(w, world)[0].clone(), spec)
        gathered = torch.cat(inputs)
        first, inner = hook.fsdp_post_all_gather((gathered.clone(),), world, torch.float32)  # FSDP2's first gather
        out = torch.full(w.shape, float("nan"))  # later gathers: into FSDP2's unsharded parameter
        assert hook.fsdp_post_all_gather((gathered,), world, torch.float32, out=out) is None
        assert gathered.untyped_storage().nbytes() == 0  # freed once dequantized
        ref, slack, s = _closed_form(w, world, bits, block, hadamard)
        tol = 1e-5 * s * (2 ** (bits - 1) - 1) + slack
        assert first.shape == (w.numel(),) and inner[0] is first
        assert ((first.double() - ref).abs() <= tol).all() and torch.equal(out.view(-1), first)
