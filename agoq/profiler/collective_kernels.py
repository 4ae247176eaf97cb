"""Time agoq's quantized collectives' own kernels in one process, with no process group: what a what-if from a
one-GPU profile adds to each quantized path's wire time (agoq.search.whatif, agoq.search.network's `Kernel`).

Each (op, path) runs exactly the runtime's kernels, in the order its collective runs them, on a flat float32 tensor
of n values (`message_bytes` = 4 n, the whole tensor as the collectives table counts it), as if the data exchanged
with the peers came back: what this rank sent to its peers stands in for what they sent to it (same shapes, same
codes; the very data where every rank's shards are equal, which the tests use to check each sequence against its
collective's result), so every dequantize and sum sees tensors of the real collective's shapes. The ranks: a
representative `world` of W ranks in nodes of G (default 2 ranks in one node, what a 2-rank run does; one node, so TLq-HS runs its
int8 level only):

  all_reduce quangrad8       (agoq.runtime.comm.quantized_allreduce, wire_rows) quantize the tensor into W rows of
                             int8 codes + scales; sum the W received rows in float32 and requantize (this rank's
                             1/W); dequantize the W gathered rows into the tensor
  reduce_scatter sdp4bit     TLq-HS (agoq.runtime.comm.sdp4bit.tlq_hs): Hadamard-32, pad to W shards; int8 codes
                             (stochastic, 128-blocks) of the whole tensor for the G local peers, dequantize and sum
                             the G pieces; where W > G, int4 codes of the node's 1/G for the W / G nodes, dequantize
                             and sum; inverse Hadamard of this rank's shard
  reduce_scatter             TLq-HS's int4 level across nodes on its own (tlq_hs's step 2), which the representative
    sdp4bit-int4-level       one node never runs: the n values taken as the node's sums (the node's 1/G of a tensor
                             G x larger, as if it were the whole: `message_bytes` = 4 n counts the values this level
                             touches), rows [M, n / M] for M = W / G nodes (M = INT4_NODES where the ranks are one
                             node); int4 codes (stochastic, 128-blocks) of the M rows, dequantize and sum them into
                             this rank's shard. Its Hadamard-32 and inverse are the int8 level's (timed in
                             reduce_scatter sdp4bit); a what-if adds this kernel at the node's 1/G of the message
                             where the ranks span nodes (agoq.search.network)
  all_gather sdp4bit         qWD (sdp4bit.qwd_all_gather): the shard's difference to the previous weights, int4
                             codes (2048-blocks, stochastic); dequantize the W gathered shards, add to the weights
  all_gather int8-weights    FSDP2's weight gather (agoq.runtime.comm.fsdp_weight_gather): quantize this rank's
  all_gather int4-weights    shard (a [n / C, C] weight over W ranks) into its all-gather bytes (int4: after
                             Hadamard-32); dequantize the W gathered shards into the bf16 unsharded weight
  all_reduce tlq4            HSDP's TLq all-reduce (agoq.runtime.comm.hsdp.tlq_all_reduce) over W replicas:
                             Hadamard-32, int4 codes of W pieces, dequantize and sum W pieces, requantize the sum,
                             dequantize the W gathered sums, inverse Hadamard

On a GPU these are the runtime's CUDA kernels (Triton where it has them) timed with synchronised host clocks
(`median_seconds`), on the CPU the same code's torch references with the host clock. Seconds are the median of
`repeats` runs after a warm-up. `fit` makes them a Kernel(fixed, per_value) per path (agoq.search.network_fit): the
per-value cost is what the what-if scales to other message sizes; the representative W and G set the fraction of
the tensor each step touches (1/W, 1/G; TLq-HS's int4 level across nodes, over the node's 1/G, is its own case).
"""

from __future__ import annotations

import torch

from agoq.formats.collective_kernels import PATHS
from agoq.profiler.kernel_time import median_seconds
from agoq.progress import progress_bar

WORLD, NODE_SIZE = 2, 2  # the representative ranks (see the module docstring)
INT4_NODES = 2  # the nodes TLq-HS's int4 level is timed over where the representative ranks are one node
GATHER_COLUMNS = 64  # columns of the weight matrix FSDP2's gather timing shards by rows


def _quangrad8(flat: torch.Tensor, world: int, node_size: int):
    from agoq.runtime.comm.quantized_allreduce import DEFAULT_BLOCK
    from agoq.runtime.comm.wire_rows import dequantize_shards, quantize_shards, row_bytes, sum_requantize
    from agoq.runtime.quant.layout import num_blocks

    block = DEFAULT_BLOCK
    per = -(-num_blocks(flat.numel(), block) // world)
    rows = torch.empty(world, row_bytes(per, block), dtype=torch.uint8, device=flat.device)
    gathered = torch.empty_like(rows)
    out = flat.clone()

    def run():
        quantize_shards(flat, list(rows.unbind(0)), per, block)  # W rows; the peers' rows come back as these
        sum_requantize(rows, [gathered[0]], per, block)  # this rank's reduced shard
        gathered[1:].copy_(gathered[0].expand(world - 1, -1))  # ... and the peers' (the all-gather)
        dequantize_shards(gathered, out, per, block)
        return out  # the sum over W ranks that all held `flat`
    return run


def _exchange_locally(values: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """sdp4bit._exchange without the all-to-all: codes of the rows [k, S], the k received rows dequantized."""
    from agoq.runtime.comm.sdp4bit import GRAD_GROUP
    from agoq.runtime.quant.codec import quantize
    from agoq.runtime.quant.qtensor import QTensor

    q = quantize(values, bits, GRAD_GROUP, "stochastic", seed=seed, check_finite=False)
    got = QTensor(q.data.reshape(-1), q.scales.reshape(-1), values.shape, torch.float32, bits, GRAD_GROUP)
    return got.dequantize(torch.float32)


def _tlq_hs(flat: torch.Tensor, world: int, node_size: int):
    from agoq.runtime.comm.hadamard import hadamard32, inverse_hadamard32
    from agoq.runtime.comm.sdp4bit import INTER_BITS, INTRA_BITS, _grouped, _to_padded, shard_bounds

    nodes = world // node_size
    start, end = shard_bounds(flat.numel(), world)[0]

    def run():
        rows = _to_padded(hadamard32(_grouped(flat)), world)
        cap = rows.shape[1]
        if node_size > 1:
            send = rows.view(nodes, node_size, cap).transpose(0, 1).contiguous()
            node_sum = _exchange_locally(send, INTRA_BITS, 1).sum(dim=0)
        else:
            node_sum = rows
        total = _exchange_locally(node_sum, INTER_BITS, 2).sum(dim=0) if nodes > 1 else node_sum[0]
        return inverse_hadamard32(total)[: end - start].contiguous()
    return run


def _tlq_hs_int4_level(flat: torch.Tensor, world: int, node_size: int):
    from agoq.runtime.comm.sdp4bit import INTER_BITS, _grouped, _to_padded

    nodes = world // node_size if world > node_size else INT4_NODES
    node_sum = _to_padded(_grouped(flat), nodes)  # [M, S]: the node's sums, one row per node (made by the int8 level)

    def run():
        return _exchange_locally(node_sum, INTER_BITS, 2).sum(dim=0)  # this rank's shard, summed over the M nodes
    return run


def _qwd(flat: torch.Tensor, world: int, node_size: int):
    from agoq.runtime.comm.sdp4bit import WEIGHT_BITS, WEIGHT_BLOCK, _from_padded, shard_bounds, shard_capacity
    from agoq.runtime.quant.codec import quantize
    from agoq.runtime.quant.qtensor import QTensor

    n = flat.numel()
    start, end = shard_bounds(n, world)[0]
    new_shard = flat[start:end] * 1.001
    cap = shard_capacity(n, world)
    width = -(-cap // WEIGHT_BLOCK) * WEIGHT_BLOCK

    def run():
        delta = flat.new_zeros(width)
        delta[: end - start] = new_shard - flat[start:end]
        q = quantize(delta, WEIGHT_BITS, WEIGHT_BLOCK, "stochastic", seed=3, check_finite=False)
        data = q.data.reshape(1, -1).expand(world, -1).reshape(-1)  # the W gathered shards
        scales = q.scales.reshape(1, -1).expand(world, -1).reshape(-1)
        deltas = QTensor(data, scales, (world, width), torch.float32, WEIGHT_BITS, WEIGHT_BLOCK)
        return torch.add(flat, _from_padded(deltas.dequantize(torch.float32)[:, :cap], n))
    return run


def _weight_gather(bits: int):
    def make(flat: torch.Tensor, world: int, node_size: int):
        from agoq.runtime.comm.fsdp_weight_gather import DEFAULT_BLOCK, dequantize_gather, quantize_shard
        from agoq.runtime.comm.weight_gather_codec import wire_layout

        cols = GATHER_COLUMNS
        rows = flat.numel() // cols
        lay = wire_layout(bits, DEFAULT_BLOCK, bits == 4, (rows, cols), world)
        local = flat[: min(lay.numel, rows * cols)]
        out = torch.empty(rows * cols, dtype=torch.bfloat16, device=flat.device)

        def run():
            mine = quantize_shard(local, lay)
            dequantize_gather(mine.repeat(world), lay, world, out)
            return out  # W copies of this rank's shard, the rest FSDP2's padding dropped
        return run
    return make


def _tlq4(flat: torch.Tensor, world: int, node_size: int):
    from agoq.runtime.comm.hadamard import hadamard32, inverse_hadamard32
    from agoq.runtime.comm.sdp4bit import GRAD_GROUP, _grouped, _to_padded
    from agoq.runtime.quant.codec import quantize
    from agoq.runtime.quant.qtensor import QTensor

    bits = 4
    out = flat.clone()

    def run():
        grouped = _grouped(flat)
        rows = _to_padded(hadamard32(grouped), world)
        cap = rows.shape[1]
        mine = _exchange_locally(rows, bits, 1).sum(dim=0)
        q = quantize(mine.view(1, cap), bits, GRAD_GROUP, "stochastic", seed=2, check_finite=False)
        codes = q.data.reshape(1, -1).expand(world, -1).reshape(-1)  # the W gathered sums
        scales = q.scales.reshape(1, -1).expand(world, -1).reshape(-1)
        total = QTensor(codes, scales, (world, cap), torch.float32, bits, GRAD_GROUP).dequantize(torch.float32)
        out.copy_(inverse_hadamard32(total.reshape(-1))[: out.numel()])
        return out
    return run


# (op, path) -> make(flat, world, node_size) -> run(): one timed run, returning what the collective would (as if
# every rank held `flat`)
CASES = {("all_reduce", "quangrad8"): _quangrad8, ("reduce_scatter", "sdp4bit"): _tlq_hs,
         ("reduce_scatter", "sdp4bit-int4-level"): _tlq_hs_int4_level,
         ("all_gather", "sdp4bit"): _qwd, ("all_gather", "int8-weights"): _weight_gather(8),
         ("all_gather", "int4-weights"): _weight_gather(4), ("all_reduce", "tlq4"): _tlq4}


def message_sizes(layer_values: int, root_values: int) -> list[int]:
    """Three message sizes (float32 bytes, whole 128-value groups of GATHER_COLUMNS-wide rows) spanning one decoder
    layer's and the root unit's values: the smaller, their geometric mean and the larger."""
    lo, hi = sorted((max(1, int(layer_values)), max(1, int(root_values))))
    if hi < 2 * lo:
        hi = 4 * lo  # two units of about one size: still three sizes, so the fit sees the slope
    mid = int((lo * hi) ** 0.5)
    step = 128  # whole 128-value groups, and so whole rows of GATHER_COLUMNS (64) values
    return [4 * (-(-v // step) * step) for v in (lo, mid, hi)]


def time_collective_kernels(sizes: list[int], device: torch.device | str, repeats: int = 5,
                            world: int = WORLD, node_size: int = NODE_SIZE, progress: bool = False) -> list[dict]:
    """Rows {op, path, message_bytes, seconds} of every quantized path (PATHS) at every size in `sizes` (float32
    bytes of the whole tensor, a multiple of 4 x GATHER_COLUMNS), timed on `device` as the module docstring says."""
    device = torch.device(device)
    if world < 2 or world % node_size:
        raise ValueError(f"the kernels are timed as a collective of 2 ranks or more in whole nodes, got world {world}"
                         f" in nodes of {node_size}")
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    bar = progress_bar(total=len(sizes) * len(PATHS), desc="collective kernels", enabled=progress)
    try:
        for size in sizes:
            if size % (4 * GATHER_COLUMNS) or size <= 0:
                raise ValueError(f"a message of {size} bytes is not whole rows of {GATHER_COLUMNS} float32 values")
            flat = torch.randn(size // 4, generator=gen, device=device) * 1e-3
            for op, path in PATHS:
                seconds = median_seconds(CASES[(op, path)](flat, world, node_size), device, repeats, warmup=1)
                rows.append({"op": op, "path": path, "message_bytes": int(size), "seconds": float(seconds)})
                bar.update(1)
    finally:
        bar.close()
    return rows


__all__ = ["PATHS", "WORLD", "NODE_SIZE", "INT4_NODES", "message_sizes", "time_collective_kernels"]
