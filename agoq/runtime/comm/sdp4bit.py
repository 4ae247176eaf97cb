"""SDP4Bit (arXiv 2410.15526): 4-bit communication for sharded (ZeRO-style) data parallelism.

Shard layout, shared by everything here: a flat tensor of n values is cut into G = ceil(n / 128)
groups of 128 values and rank r of W owns groups [r*b + min(r, x), ...) where b, x = divmod(G, W):
the first x ranks own b + 1 groups, the others b (so shard sizes differ by at most one group), and
the last non-empty shard ends at n. Rank r always owns the r-th *contiguous* slice, as with a plain
reduce-scatter; `shard_bounds` gives the slices. On the wire every shard is padded with zeros to the
largest shard, S = ceil(G / W) * 128 values, so all collectives move equal-sized chunks.

- `tlq_hs_reduce_scatter`: TLq-HS, the gradient reduce-scatter in two levels (int8 inside a node,
  int4 across nodes, Hadamard-32 to flatten outliers); `exact_reduce_scatter` is the fp32 reference.
- `qwd_all_gather`: qWD, the weight all-gather of 4-bit *differences* to the previous weights, which
  every rank (the owner too) applies, so replicas stay bit-identical. agoq's own sharded optimizer that used it
  was retired (FSDP2 gathers weights as block codes: agoq.runtime.comm.fsdp_weight_gather); it stays a library
  piece that the collective benchmarks (agoq.profiler.collectives, experiments/bench_sdp4bit.py) measure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agoq.runtime.comm import lanes as _lanes
from agoq.runtime.comm.hadamard import hadamard32, inverse_hadamard32
from agoq.runtime.quant.qtensor import QTensor
from agoq.runtime.quant.layout import check_arguments
from agoq.runtime.quant.codec import quantize

GRAD_GROUP = 128  # values per gradient quantization group; shards are made of whole groups
INTRA_BITS = 8  # gradient bits inside a node (levels -127..127)
INTER_BITS = 4  # gradient bits across nodes (levels -7..7)
WEIGHT_BITS = 4  # qWD delta bits
WEIGHT_BLOCK = 2048  # qWD delta quantization group


# ----------------------------------------------------------------------------------------- layout

def shard_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's contiguous shard of a flat tensor of `numel` values (whole 128-groups)."""
    groups = -(-numel // GRAD_GROUP)
    base, extra = divmod(groups, world)
    bounds, g = [], 0
    for r in range(world):
        size = base + (r < extra)
        bounds.append((min(g * GRAD_GROUP, numel), min((g + size) * GRAD_GROUP, numel)))
        g += size
    return bounds


def shard_capacity(numel: int, world: int) -> int:
    """Values per shard on the wire: the largest shard, a multiple of 128 (every shard is padded to it)."""
    groups = -(-numel // GRAD_GROUP)
    return -(-groups // world) * GRAD_GROUP


def _to_padded(flat: torch.Tensor, world: int) -> torch.Tensor:
    """[world, S] float32: row r holds rank r's shard of `flat` (fp32, length a multiple of 128), zero-padded."""
    groups = flat.numel() // GRAD_GROUP
    base, extra = divmod(groups, world)
    cap = (base + (extra > 0)) * GRAD_GROUP
    short = base * GRAD_GROUP
    if extra == 0:
        return flat.view(world, cap)  # equal shards: no padding, no copy
    out = flat.new_zeros(world, cap)
    out[:extra] = flat[: extra * cap].view(extra, cap)
    out[extra:, :short] = flat[extra * cap:].view(world - extra, short)
    return out


def _from_padded(rows: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `_to_padded`: the flat tensor of `numel` values from [world, S] padded shards."""
    world = rows.shape[0]
    groups = -(-numel // GRAD_GROUP)
    base, extra = divmod(groups, world)
    if extra == 0:  # equal shards: a view when the rows are contiguous
        return rows[:, : base * GRAD_GROUP].reshape(-1)[:numel]
    flat = torch.cat([rows[:extra].reshape(-1), rows[extra:, : base * GRAD_GROUP].reshape(-1)])
    return flat[:numel]


def _grouped(flat: torch.Tensor) -> torch.Tensor:
    """`flat` as float32, zero-padded to a whole number of 128-groups."""
    flat = flat.reshape(-1).float()
    tail = (-flat.numel()) % GRAD_GROUP
    return torch.cat([flat, flat.new_zeros(tail)]) if tail else flat


# ---------------------------------------------------------------------------------- process groups

def _world_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("SDP4Bit needs torch.distributed: call dist.init_process_group first "
                           "(e.g. under torchrun)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return dist.get_world_size(group), rank


def _is_default(group) -> bool:
    return group is None or group is dist.group.WORLD


def _resolve_node_size(node_size: int | None, world: int, default_group: bool) -> int:
    source = "node_size"
    if node_size is None:  # the launcher's ranks per node describe the default group only
        env = os.environ.get("LOCAL_WORLD_SIZE", "") if default_group and world > 1 else ""
        node_size, source = (int(env), "LOCAL_WORLD_SIZE") if env else (world, "node_size")
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be a positive integer, got {node_size!r}")
    if world % node_size:
        raise ValueError(f"the world size {world} is not a multiple of the node size {node_size} (from {source}): "
                         "TLq-HS needs every node to hold the same number of ranks; pass node_size explicitly")
    return node_size


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: rank = node * node_size + local. intra/inter are the sub-groups of its node and
    of the ranks with its local index on every node (used only when node_size > 1, resp. nodes > 1)."""

    world: int
    rank: int
    node_size: int
    nodes: int
    intra: object
    inter: object


_NODE_GROUPS: dict[tuple[int, int], tuple[object, list, list]] = {}


def _node_groups(world: int, rank: int, node_size: int) -> tuple[object, object]:
    """This rank's (intra-node, inter-node) sub-groups of the default group, created once per world and
    node size. Every rank creates every sub-group, in the same order, as dist.new_group requires."""
    cached = _NODE_GROUPS.get((world, node_size))
    if cached is None or cached[0] is not dist.group.WORLD:  # a re-initialized world drops old groups
        nodes = world // node_size
        intra = [dist.new_group([n * node_size + i for i in range(node_size)]) for n in range(nodes)]
        inter = [dist.new_group([n * node_size + i for n in range(nodes)]) for i in range(node_size)]
        cached = _NODE_GROUPS[(world, node_size)] = (dist.group.WORLD, intra, inter)
    return cached[1][rank // node_size], cached[2][rank % node_size]


def topology(group=None, *, intra_group=None, inter_group=None, node_size: int | None = None) -> Topology:
    """Resolve TLq-HS's two levels for this rank (collective when it must create sub-groups).

    Nodes are consecutive ranks: rank r is on node r // node_size with local index r % node_size.
    node_size defaults to the launcher's LOCAL_WORLD_SIZE for the default group, else to the whole
    group (one node). Any node size gives the right sum; it only decides which exchange is int8. For a
    group other than the default one with several nodes of several ranks, create the sub-groups
    yourself (on every process) and pass intra_group (this rank's node, ordered by local index) and
    inter_group (the ranks with this rank's local index, ordered by node).
    """
    world, rank = _world_rank(group)
    if intra_group is not None or inter_group is not None:
        if intra_group is None or inter_group is None:
            raise ValueError("pass both intra_group and inter_group, or neither")
        size, nodes = dist.get_world_size(intra_group), dist.get_world_size(inter_group)
        if node_size is not None and node_size != size:
            raise ValueError(f"node_size={node_size} but intra_group has {size} ranks")
        if size * nodes != world:
            raise ValueError(f"intra_group ({size} ranks) x inter_group ({nodes} ranks) != world size {world}")
        if dist.get_rank(intra_group) != rank % size or dist.get_rank(inter_group) != rank // size:
            raise ValueError(f"rank {rank} must be rank {rank % size} of intra_group and {rank // size} of "
                             "inter_group (nodes are consecutive ranks)")
        return Topology(world, rank, size, nodes, intra_group, inter_group)
    size = _resolve_node_size(node_size, world, _is_default(group))
    nodes = world // size
    if size == 1 or nodes == 1:
        return Topology(world, rank, size, nodes, group if size > 1 else None, group if nodes > 1 else None)
    if not _is_default(group):
        raise ValueError(f"{nodes} nodes of {size} ranks in a non-default group: create the node sub-groups on "
                         "every process and pass intra_group and inter_group")
    intra, inter = _node_groups(world, rank, size)
    return Topology(world, rank, size, nodes, intra, inter)


# -------------------------------------------------------------------------------------- helpers

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def derive_seed(seed: int | None, *salt: int) -> int:
    """A 31-bit seed from `seed` and salts (rank, stage, step); seed None draws from torch's generator."""
    x = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed) & _M64
    for s in salt:
        x = _mix(x ^ _mix(int(s) & _M64))
    return x % (2**31 - 1)


def _check_flat(x: torch.Tensor, name: str, allow_empty: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if x.numel() == 0 and not allow_empty:
        raise ValueError(f"{name} is empty")
    return x.reshape(-1)


def _all_gather(x: torch.Tensor, group, world: int, count: int = 1) -> torch.Tensor:
    """[world, *x.shape]: every rank's `x` (equal shapes), in rank order."""
    return _lanes.all_gather(x, _lanes.lanes(group, count), world)


def _exchange(values: torch.Tensor, bits: int, seed: int, group, count: int = 1) -> torch.Tensor:
    """All-to-all of fp32 rows [k, S] as `bits`-bit codes (128-blocks, stochastic) + scales; returns the
    k received rows dequantized to fp32, row j coming from rank j of `group`."""
    q = quantize(values, bits, GRAD_GROUP, "stochastic", seed=seed, check_finite=False)
    k = values.shape[0]
    data = _lanes.all_to_all(q.data.view(k, -1), _lanes.lanes(group, count)).view(-1)
    scales = _lanes.all_to_all(q.scales.view(k, -1), [group]).view(-1)
    got = QTensor(data, scales, values.shape, torch.float32, bits, GRAD_GROUP)
    return got.dequantize(torch.float32)


# -------------------------------------------------------------------------------------- collectives

def exact_reduce_scatter(flat: torch.Tensor, group=None) -> torch.Tensor:
    """Reference reduce-scatter: this rank's shard (see `shard_bounds`) of the fp32 sum over ranks."""
    flat = _check_flat(flat, "flat")
    world, rank = _world_rank(group)
    total = flat.float().clone()
    if world > 1:
        dist.all_reduce(total, group=group)
    start, end = shard_bounds(flat.numel(), world)[rank]
    return total[start:end].clone()


def tlq_hs_reduce_scatter(
    flat_grad: torch.Tensor,
    group=None,
    *,
    intra_group=None,
    inter_group=None,
    node_size: int | None = None,
    hadamard: bool = True,
    seed: int | None = None,
    lanes: int = 1,
) -> torch.Tensor:
    """TLq-HS: this rank's shard (fp32, `shard_bounds` layout) of the sum of every rank's flat gradient.

    1. Hadamard-32 transform (if `hadamard`); int8 codes + scales (128-blocks, stochastic rounding)
       all-to-all inside the node; dequantize and sum in fp32.
    2. The node sums, requantized to int4, all-to-all across nodes among the ranks with the same local
       index; dequantize, sum in fp32, inverse Hadamard.
    Who owns what: the gradient is viewed as [nodes, node_size, S] (shard r = node n, local index i).
    In step 1 rank (n, i) sends to local peer j the shards {m*node_size + j : every node m}, so it
    receives and sums the node's contributions to the shards of local index i on every node. In step 2
    it sends node m's entry, shard m*node_size + i, to rank (m, i), and so receives shard
    n*node_size + i = r from every node: rank r ends up with the r-th contiguous shard.
    One node (node_size = world): step 1 is the whole reduce-scatter. One rank per node: step 1 moves
    nothing and is skipped (no int8 rounding). One rank: the gradient itself, unquantized.
    A non-finite input never raises here (that would hang the other ranks): the 128-groups of the
    result that it touches come out NaN. `seed` seeds the rounding noise (mixed with rank and stage);
    None draws from torch's generator. `lanes` > 1 spreads each exchange's codes over that many
    communicators of the same ranks (agoq/runtime/comm/lanes.py; same result, more socket connections).
    """
    flat = _check_flat(flat_grad, "flat_grad")
    topo = topology(group, intra_group=intra_group, inter_group=inter_group, node_size=node_size)
    return tlq_hs(flat, topo, hadamard, derive_seed(seed), lanes)


def tlq_hs(flat: torch.Tensor, topo: Topology, hadamard: bool, seed: int, lanes: int = 1) -> torch.Tensor:
    n, world, rank = flat.numel(), topo.world, topo.rank
    start, end = shard_bounds(n, world)[rank]
    if world == 1:
        return flat.float().clone()
    grouped = _grouped(flat)
    rows = _to_padded(hadamard32(grouped) if hadamard else grouped, world)  # [world, S]
    cap = rows.shape[1]
    size, nodes = topo.node_size, topo.nodes
    if size > 1:  # step 1, int8 inside the node: send to local peer j the shards of local index j
        send = rows.view(nodes, size, cap).transpose(0, 1).contiguous()  # [size, nodes, S]
        node_sum = _exchange(send, INTRA_BITS, derive_seed(seed, rank, 1), topo.intra, lanes).sum(dim=0)
    else:
        node_sum = rows  # [nodes, S]: this rank is its whole node
    if nodes > 1:  # step 2, int4 across nodes: send node m's entry to rank (m, my local index)
        total = _exchange(node_sum, INTER_BITS, derive_seed(seed, rank, 2), topo.inter, lanes).sum(dim=0)
    else:
        total = node_sum[0]
    shard = inverse_hadamard32(total) if hadamard else total
    return shard[: end - start].contiguous()


def exact_all_gather(shard: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    """Every rank's shard (`shard_bounds` layout of `numel` values) gathered into one flat fp32 tensor."""
    world, rank = _world_rank(group)
    start, end = shard_bounds(numel, world)[rank]
    if shard.numel() != end - start:
        raise ValueError(f"rank {rank} owns values [{start}, {end}) of {numel}: its shard must hold "
                         f"{end - start} values, got {shard.numel()}")
    padded = shard.new_zeros(shard_capacity(numel, world), dtype=torch.float32)
    padded[: end - start] = shard.reshape(-1)
    return _from_padded(_all_gather(padded, group, world), numel)


def qwd_all_gather(
    new_shard: torch.Tensor,
    prev_full: torch.Tensor,
    group=None,
    *,
    block: int = WEIGHT_BLOCK,
    seed: int | None = None,
    lanes: int = 1,
) -> torch.Tensor:
    """qWD: the new full weights from every rank's updated shard, sending 4-bit weight differences.

    prev_full: the previous full weights, identical on every rank (any shape; flat order). new_shard:
    this rank's updated values of its `shard_bounds` slice of prev_full. Each rank quantizes
    delta = new_shard - prev_full[slice] to 4 bits (`block` values per fp32 scale, stochastic rounding,
    so dequant(delta) is unbiased), the codes and scales are all-gathered, and every rank, the owner
    included, computes prev_full + dequant(delta) in fp32 for every shard: all replicas are
    bit-identical, and an owner's next delta (against these shared weights) carries this step's
    rounding error forward instead of letting it accumulate. Returns a tensor of prev_full's shape
    and dtype. A non-finite delta on any rank raises FloatingPointError on every rank. `lanes` > 1
    spreads the codes over that many communicators (see tlq_hs_reduce_scatter).
    """
    prev = _check_flat(prev_full, "prev_full")
    new_shard = _check_flat(new_shard, "new_shard", allow_empty=True)  # small tensors leave some ranks none
    check_arguments(WEIGHT_BITS, block, "stochastic", "int")
    world, rank = _world_rank(group)
    n = prev.numel()
    start, end = shard_bounds(n, world)[rank]
    if new_shard.numel() != end - start:
        raise ValueError(f"rank {rank} owns values [{start}, {end}) of prev_full's {n}: new_shard must hold "
                         f"{end - start} values, got {new_shard.numel()}")
    if new_shard.device != prev.device:
        raise ValueError(f"new_shard is on {new_shard.device} but prev_full on {prev.device}")
    width = -(-shard_capacity(n, world) // block) * block  # every rank sends whole blocks of equal count
    delta = prev.new_zeros(width, dtype=torch.float32)
    delta[: end - start] = new_shard.float() - prev[start:end].float()
    q = quantize(delta, WEIGHT_BITS, block, "stochastic", seed=derive_seed(seed, rank, 3), check_finite=False)
    data, scales = _all_gather(q.data, group, world, lanes), _all_gather(q.scales, group, world)
    finite = torch.isfinite(scales).all(dim=1)
    if not bool(finite.all()):
        bad = [r for r in range(world) if not bool(finite[r])]
        raise FloatingPointError(f"qWD: the weight update of rank(s) {bad} holds inf or NaN; weights not gathered")
    deltas = QTensor(data.view(-1), scales.view(-1), (world, width), torch.float32, WEIGHT_BITS, block)
    deltas = deltas.dequantize(torch.float32)
    cap = shard_capacity(n, world)
    full = torch.add(prev, _from_padded(deltas[:, :cap], n))  # computed in fp32 whatever prev's dtype
    return full.to(prev_full.dtype).view(prev_full.shape)


# --------------------------------------------------------------------------------------- optimizer
