"""QuanGrad's precision-preserving 8-bit all-reduce.

A plain reduce-scatter of int8 values would add them on the wire and overflow, so the sum is never
taken in 8 bits:
  1. the tensor is block-quantized to int8 (one float32 scale per block), and its blocks are split
     into W contiguous shards of ceil(blocks / W) blocks each (the last ones may be short or empty);
  2. all-to-all: rank j receives shard j, codes and scales, from every rank;
  3. rank j dequantizes the W copies of its shard, sums them in float32,
  4. and requantizes the sum with fresh scales;
  5. all-gather: every rank receives every reduced shard,
  6. and dequantizes them: all ranks end with bit-identical results.
Each value is rounded twice (once locally, once after the sum) whatever the world size, so the error
does not grow with W the way a ring of rounded partial sums would.

A block holding inf or NaN on any rank makes that block NaN on every rank after the reduction (the
way AMP's overflow check expects to find it); `check_finite=True` raises instead, on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from agoq.runtime.qtensor import QTensor, int_qmax, num_blocks
from agoq.runtime.quantize import dequantize, quantize

DEFAULT_BLOCK = 256
MIN_NUMEL = 1 << 16  # tensors with fewer values take the plain all-reduce: too small to gain
_ZERO_CODE = int_qmax(8)  # the code of 0.0 in the symmetric 8-bit format


def _all_gather_flat(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, mine, group=group)
    else:
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), mine, group=group)


def sum_shards_reference(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """float32 sum over W of dequantized shards: codes [W, blocks * block] uint8, scales [W, blocks]."""
    w, nb = scales.shape
    values = (codes.reshape(w, nb, block).to(torch.float32) - _ZERO_CODE) * scales.reshape(w, nb, 1)
    return values.sum(0).view(-1)


def sum_shards(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """`sum_shards_reference` through the Triton kernel on CUDA (rows may be strided views)."""
    if not codes.is_cuda:
        return sum_shards_reference(codes, scales, block)
    from agoq.runtime.shard_sum_triton import sum_shards_triton

    return sum_shards_triton(codes, scales, block, _ZERO_CODE)


def _pack_rows(codes: torch.Tensor, scales: torch.Tensor, rows: int, per: int, block: int) -> torch.Tensor:
    """One uint8 buffer [rows, per*block + 4*per]: each row holds one shard's codes, then its scales."""
    width = per * block
    buf = torch.empty(rows, width + 4 * per, dtype=torch.uint8, device=codes.device)
    buf[:, :width].copy_(codes.view(rows, width))
    buf[:, width:].copy_(scales.view(rows, per).contiguous().view(torch.uint8))
    return buf


def _split_rows(buf: torch.Tensor, per: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (codes [rows, per*block], scales [rows, per] float32) into a buffer from `_pack_rows`."""
    width = per * block
    return buf[:, :width], buf[:, width:].view(torch.float32)


def all_reduce_codes(data: torch.Tensor, scales: torch.Tensor, numel: int, block: int, group=None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum 8-bit block-quantized tensors over `group`: steps 2-5 above on (codes, scales) of `numel` values.

    Each shard travels as one row of codes followed by its scales, so the reduction takes two
    collectives. Returns the reduced (codes [numel] uint8, scales [blocks] float32), identical on
    every rank.
    """
    world = dist.get_world_size(group)
    nb = num_blocks(numel, block)
    per = -(-nb // world)  # blocks per shard
    codes = torch.full((world * per * block,), _ZERO_CODE, dtype=torch.uint8, device=data.device)
    codes[:numel].copy_(data[:numel])
    sc = torch.zeros(world * per, dtype=torch.float32, device=data.device)
    sc[:nb].copy_(scales)
    send = _pack_rows(codes, sc, world, per, block)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    total = sum_shards(*_split_rows(recv, per, block), block)
    mine = quantize(total, 8, block, check_finite=False)
    gathered = torch.empty_like(send)
    _all_gather_flat(gathered.view(-1), _pack_rows(mine.data, mine.scales, 1, per, block).view(-1), group)
    out_codes, out_scales = _split_rows(gathered, per, block)
    return out_codes.reshape(-1)[:numel], out_scales.reshape(-1)[:nb]


def quantized_all_reduce(tensor: torch.Tensor, group=None, *, average: bool = False, block: int = DEFAULT_BLOCK,
                         min_numel: int = MIN_NUMEL, check_finite: bool = False) -> torch.Tensor:
    """All-reduce `tensor` in place (sum, or mean with average=True) sending 8-bit codes plus scales.

    Like `dist.all_reduce`, every rank calls it with a tensor of the same shape; on return all ranks
    hold bit-identical results. Tensors under `min_numel` values (or not floating point) take the plain
    all-reduce. Wire bytes per value: about 2 x (1 + 4/block) instead of 2 x 4 for an fp32 ring.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"quantized_all_reduce takes a torch.Tensor, got {type(tensor).__name__}")
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    if not tensor.is_floating_point() or tensor.numel() < min_numel:
        dist.all_reduce(tensor, group=group)
        if average:
            tensor.div_(world) if tensor.is_floating_point() else tensor.floor_divide_(world)
        return tensor
    flat = tensor.detach().reshape(-1)
    q = quantize(flat, 8, block, check_finite=False)
    codes, scales = all_reduce_codes(q.data, q.scales, flat.numel(), block, group)
    if check_finite and not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).sum())
        raise FloatingPointError(f"quantized_all_reduce: the reduced tensor has {bad} block(s) of {block} values "
                                 "holding inf or NaN (some rank's input was not finite)")
    if average:
        scales = scales / world
    reduced = QTensor(codes, scales, flat.shape, torch.float32, 8, block)
    if tensor.is_cuda and tensor.is_contiguous():  # dequantize straight into the caller's tensor
        from agoq.runtime.quant_triton import dequantize_triton

        dequantize_triton(codes, scales, 8, block, flat.numel(), "int", tensor.dtype, out=tensor.view(-1))
    else:
        tensor.copy_(dequantize(reduced, torch.float32).view(tensor.shape))
    return tensor
