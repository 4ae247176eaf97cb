"""QuanGrad's precision-preserving 8-bit all-reduce.

A plain reduce-scatter of int8 values would add them on the wire and overflow, so the sum is never
taken in 8 bits:
  1. the tensor is block-quantized to int8 (one float32 scale per block), and its blocks are split
     into W contiguous shards of ceil(blocks / W) blocks each (the last ones may be short or empty);
  2. rank j receives shard j, codes and scales, from every rank (an all-to-all);
  3. rank j dequantizes the W copies of its shard, sums them in float32,
  4. and requantizes the sum with fresh scales;
  5. every rank receives every reduced shard (an all-gather),
  6. and dequantizes them: all ranks end with bit-identical results.
Each value is rounded twice (once locally, once after the sum) whatever the world size, so the error
does not grow with W the way a ring of rounded partial sums would.

Shards travel as rows of codes followed by scales (agoq/runtime/comm/wire_rows.py), written and read by
the kernels in place. Steps 2 and 5 are NCCL / gloo collectives, or, between the GPUs of one node
under NCCL, direct writes into the peers' symmetric memory (agoq/runtime/comm/symmetric_transport.py);
AGOQ_ALLREDUCE_TRANSPORT=collectives forces the collectives.

A block holding inf or NaN on any rank makes that block NaN on every rank after the reduction (the
way AMP's overflow check expects to find it); `check_finite=True` raises instead, on every rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from agoq.runtime.comm.symmetric_transport import Workspace
from agoq.runtime.comm.wire_rows import (
    ZERO_CODE,
    dequantize_shards,
    quantize_shards,
    row_bytes,
    split_row,
    sum_requantize,
)
from agoq.runtime.quant.layout import num_blocks

DEFAULT_BLOCK = 256
MIN_NUMEL = 1 << 16  # tensors with fewer values take the plain all-reduce: too small to gain
_ZERO_CODE = ZERO_CODE


def _all_gather_rows(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out.view(-1), mine, group=group)
    else:
        dist.all_gather(list(out.unbind(0)), mine, group=group)


def _layout(numel: int, block: int, world: int) -> tuple[int, int]:
    """(blocks per shard, bytes per row)."""
    per = -(-num_blocks(numel, block) // world)
    return per, row_bytes(per, block)


def _symmetric_rows(ws: Workspace, p: int, fill, per: int, block: int) -> torch.Tensor:
    """Steps 2-5 through symmetric memory, buffer set `p` (see symmetric_transport): `fill(rows, table)`
    writes this rank's W shards straight into the peers' inboxes."""
    world, rank = ws.world, ws.rank
    rb = row_bytes(per, block)
    fill([ws.inbox(d, p, rb)[rank] for d in range(world)], ws.table("inbox", p, rb))
    ws.barrier()
    sum_requantize(ws.inbox(rank, p, rb), [ws.outbox(d, p, rb)[rank] for d in range(world)], per, block,
                   ws.table("outbox", p, rb))
    ws.barrier()
    return ws.outbox(rank, p, rb)


PIPELINE_MAX_CHUNKS = 4  # chunks of a large symmetric-memory reduction, alternating between two streams
PIPELINE_CHUNK_BLOCKS = 4096  # at least this many blocks per shard and chunk (8 chunks measured slower)


COPY_ENGINE_MIN_ROW_BYTES = 64 * 2**20  # rows at least this large go by DMA copies in "auto" mode


def push_mode(rb: int) -> str:
    """How rows of `rb` bytes reach the peers over symmetric memory: "stores" (kernels store straight
    into the peers' rows: fewest operations, best for small and mid-sized tensors) or "copy-engine"
    (kernels write local rows and DMA copies move them, leaving the SMs free: best for large ones).
    AGOQ_ALLREDUCE_PUSH=stores|copy-engine|auto (default auto) chooses."""
    mode = os.environ.get("AGOQ_ALLREDUCE_PUSH", "auto")
    if mode not in ("auto", "copy-engine", "stores"):
        raise ValueError(f"AGOQ_ALLREDUCE_PUSH must be auto, copy-engine or stores, got {mode!r}")
    if mode == "auto":
        return "copy-engine" if rb >= COPY_ENGINE_MIN_ROW_BYTES else "stores"
    return mode


def _symmetric_reduce(ws: Workspace, p: int, flat: torch.Tensor, per: int, block: int, divisor: int,
                      mode: str) -> None:
    """Steps 1-6 through symmetric memory on buffer set `p`, in place on the contiguous CUDA `flat`.

    Large tensors go in chunks of blocks on two streams, so one chunk's NVLink-bound steps overlap
    another chunk's memory-bound ones (quantize, dequantize)."""
    from agoq.runtime.comm.wire_triton import (
        dequantize_rows_triton,
        quantize_to_rows_triton,
        sum_requantize_rows_triton,
    )

    rb = row_bytes(per, block)
    rank, world = ws.rank, ws.world
    inbox, outbox = ws.inbox(rank, p, rb), ws.outbox(rank, p, rb)
    if mode == "stores":
        in_table, out_table = ws.table("inbox", p, rb), ws.table("outbox", p, rb)
    else:
        staging = ws.staging(p, rb)  # local rows for the other ranks' shards
        in_table, out_table = ws.table("staging", p, rb), ws.table("own-outbox", p, rb)

    def push(src_rows, dst_box, chunk) -> None:
        j0, count = (0, per) if chunk is None else chunk
        for d in range(world):
            if d == rank:
                continue
            src, dst = src_rows[d], dst_box(d, p, rb)[rank]
            dst[j0 * block:(j0 + count) * block].copy_(src[j0 * block:(j0 + count) * block])
            dst[per * block + 4 * j0:per * block + 4 * (j0 + count)].copy_(
                src[per * block + 4 * j0:per * block + 4 * (j0 + count)])

    def run(chunk, channel: int) -> None:
        quantize_to_rows_triton(flat, in_table, per, block, chunk)
        if mode != "stores":
            push(staging, ws.inbox, chunk)
        ws.barrier(channel)
        sum_requantize_rows_triton(inbox, out_table, per, block, chunk)
        if mode != "stores":
            push([outbox[rank]] * world, ws.outbox, chunk)
        ws.barrier(channel)
        dequantize_rows_triton(outbox, flat, per, block, divisor, chunk)

    chunks = min(PIPELINE_MAX_CHUNKS, max(1, per // PIPELINE_CHUNK_BLOCKS))
    if chunks == 1:
        run(None, 0)
        return
    edges = [per * i // chunks for i in range(chunks + 1)]
    main = torch.cuda.current_stream()
    streams = ws.streams()
    for s in streams:
        s.wait_stream(main)
    for i in range(chunks):
        with torch.cuda.stream(streams[i % 2]):
            run((edges[i], edges[i + 1] - edges[i]), i % 2)
    for s in streams:
        main.wait_stream(s)


def _collective_rows(fill, per: int, block: int, device: torch.device, group) -> torch.Tensor:
    """Steps 2-5 with an all-to-all and an all-gather."""
    world = dist.get_world_size(group)
    rb = row_bytes(per, block)
    send = torch.empty(world, rb, dtype=torch.uint8, device=device)
    fill(list(send.unbind(0)), None)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    mine = torch.empty(rb, dtype=torch.uint8, device=device)
    sum_requantize(recv, [mine], per, block)
    gathered = torch.empty_like(send)
    _all_gather_rows(gathered, mine, group)
    return gathered


def _reduce_rows(fill, per: int, block: int, device: torch.device, group) -> torch.Tensor:
    """Steps 2-5: `fill(rows, table)` writes this rank's W shards into `rows` (table: their addresses, or
    None); returns the gathered reduced rows [W, row_bytes], identical on every rank (valid until the
    next call on this group)."""
    ws = Workspace.get(group, row_bytes(per, block)) if device.type == "cuda" else None
    if ws is not None:
        return _symmetric_rows(ws, ws.flip(), fill, per, block)
    return _collective_rows(fill, per, block, device, group)


def all_reduce_codes(data: torch.Tensor, scales: torch.Tensor, numel: int, block: int, group=None,
                     divisor: int = 1) -> None:
    """Sum 8-bit block-quantized values over `group`, in place: codes `data` [>= numel] uint8 and
    `scales` [blocks] float32 of `numel` values (QuanGrad's gradient storage, which stays 8-bit).
    The reduced scales are divided by `divisor` (the world size for a mean); all ranks end identical."""
    world = dist.get_world_size(group)
    nb = num_blocks(numel, block)
    per, _ = _layout(numel, block, world)
    width = per * block

    def fill(rows: list[torch.Tensor], table) -> None:
        for d, row in enumerate(rows):
            codes, sc = split_row(row, per, block)
            lo, hi = min(numel, d * width), min(numel, (d + 1) * width)
            codes[:hi - lo].copy_(data[lo:hi])
            codes[hi - lo:].fill_(ZERO_CODE)
            blo, bhi = min(nb, d * per), min(nb, (d + 1) * per)
            sc[:bhi - blo].copy_(scales[blo:bhi])
            sc[bhi - blo:].zero_()

    gathered = _reduce_rows(fill, per, block, data.device, group)
    out_codes, out_scales = split_row(gathered, per, block)
    for d in range(world):
        lo, hi = min(numel, d * width), min(numel, (d + 1) * width)
        data[lo:hi].copy_(out_codes[d, :hi - lo])
        blo, bhi = min(nb, d * per), min(nb, (d + 1) * per)
        if divisor == 1:
            scales[blo:bhi].copy_(out_scales[d, :bhi - blo])
        else:
            torch.div(out_scales[d, :bhi - blo], divisor, out=scales[blo:bhi])


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
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.detach().view(-1)
    per, rb = _layout(flat.numel(), block, world)
    divisor = world if average else 1

    def fill(rows: list[torch.Tensor], table) -> None:
        quantize_shards(flat, rows, per, block, table)

    def drain(gathered: torch.Tensor) -> None:
        dequantize_shards(gathered, flat, per, block, divisor)

    ws = Workspace.get(group, rb) if flat.is_cuda and block & (block - 1) == 0 else None
    if ws is not None:
        p = ws.flip()
        mode = push_mode(rb)
        key = (flat.data_ptr(), flat.numel(), flat.dtype, block, divisor, mode)
        ws.run(key, p, lambda: _symmetric_reduce(ws, p, flat, per, block, divisor, mode))
        gathered = ws.outbox(ws.rank, p, rb)
    else:
        gathered = _collective_rows(fill, per, block, flat.device, group)
        drain(gathered)
    scales = split_row(gathered, per, block)[1]
    if work is not tensor:
        tensor.copy_(work)
    if check_finite and not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).sum())
        raise FloatingPointError(f"quantized_all_reduce: the reduced tensor has {bad} block(s) of {block} values "
                                 "holding inf or NaN (some rank's input was not finite)")
    return tensor
