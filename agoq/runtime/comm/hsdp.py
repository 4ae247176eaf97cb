"""HSDP: FSDP2 over a 2-D mesh (replicas across nodes, shards within a node), with the cross-node gradient all-reduce
exact, in 8 bits (QuanGrad's) or in 4 bits (TLq's inter-node level).

The mesh (`hybrid_mesh`) is R x S ranks, dims named ("replicate", "shard"): rank = r * S + s, so each row is S
consecutive ranks, one node as torchrun numbers them. Parameters, gradients and optimizer state are 1/S per rank,
and the R ranks of a column hold the same shard.

What FSDP2 offers for the cross-node step (torch 2.11 to 2.13, torch.distributed.fsdp._fully_shard):

- native HSDP, `fully_shard(mesh=<2-D mesh>)`: FSDP2 reduce-scatters within the shard dim, then calls
  `dist.all_reduce` over the replicate dim itself (its `foreach_reduce`); that call cannot be replaced.
  `set_all_reduce_hook` runs *after* it, and `set_requires_all_reduce(False)` only defers it (gradient
  accumulation). agoq uses native HSDP for the exact all-reduce (all_reduce="exact").
- `fully_shard(mesh=<the shard row, 1-D>)` with `set_all_reduce_hook(hook)`: FSDP2 calls the hook on each unit's
  reduce-scatter output (`hook(reduce_output)`, in place, on its all-reduce stream) before it divides and writes
  the sharded `.grad` -- its documented place for a custom HSDP all-reduce ("native HSDP is not enabled, but
  user may want to have a custom HSDP setup"). agoq's quantized all-reduces run there (`ReplicaAllReduce`).

Either way FSDP2 divides by S (the ranks it reduce-scattered over; or the reduce-scatter averaged), and the hook
sums over the R replicas and divides by R: every rank ends with its shard of the mean gradient over R x S ranks.
The DTensors of the two forms differ in placement only ((Replicate, Shard(0)) on the 2-D mesh; Shard(0) on the
row); torch.distributed.checkpoint saves each replicated shard once and reloads it at any world size.

Quantized all-reduces (each leaves every replica with bit-identical values, so the replicas' optimizer steps
stay identical):

- "quangrad8": `agoq.runtime.comm.quantized_allreduce.quantized_all_reduce` (int8 block codes, one float32
  scale per 256 values, nearest rounding; each value rounded twice whatever R).
- "tlq4": `tlq_all_reduce` -- Hadamard-32, `bits`-bit codes (4: levels -7..7) with one float32 scale per 128
  values and stochastic rounding, an all-to-all of R pieces, the R copies of this rank's piece summed in float32,
  requantized the same way and all-gathered, inverse Hadamard. Error: with s_i the step of value i's 128-block
  in the first exchange and t_i in the second (max|block| / 7 each), every transformed value moves by less than
  s_i (each of the R contributions) plus t_i, so ||error||_2 < sqrt(128) / 7 * (sum_r ||g_r||_2 + ||sum||_2)
  per 128-block summed over blocks (the transform is orthonormal); stochastic rounding makes it unbiased.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ALL_REDUCES = ("exact", "quangrad8", "tlq4")
MESH_DIMS = ("replicate", "shard")


def hybrid_mesh(device: torch.device | str, replicate: int, shard: int):
    """The R x S DeviceMesh of HSDP over every rank of the default group, dims ("replicate", "shard")."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("HSDP needs torch.distributed: launch under torchrun (or call dist.init_process_group) "
                           "before sharding the model")
    if replicate * shard != dist.get_world_size():
        raise ValueError(f"HSDP over replicate {replicate} x shard {shard} = {replicate * shard} ranks, the world "
                         f"has {dist.get_world_size()}: give a node size that divides the world")
    return init_device_mesh(torch.device(device).type, (replicate, shard), mesh_dim_names=MESH_DIMS)


@torch.no_grad()
def tlq_all_reduce(tensor: torch.Tensor, group=None, *, bits: int = 4, hadamard: bool = True,
                   seed: int = 0) -> torch.Tensor:
    """Sum `tensor` (float, contiguous) over `group` in place, sending `bits`-bit codes (see the module docstring,
    "tlq4"); every rank ends with the same values. `seed` seeds the stochastic rounding (mixed with the rank and
    the stage)."""
    from agoq.runtime.comm.hadamard import hadamard32, inverse_hadamard32
    from agoq.runtime.comm.sdp4bit import GRAD_GROUP, _all_gather, _exchange, _grouped, _to_padded, derive_seed
    from agoq.runtime.quant.codec import quantize
    from agoq.runtime.quant.qtensor import QTensor

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or tensor.numel() == 0:
        return tensor
    flat = tensor.view(-1)
    grouped = _grouped(flat)
    rows = _to_padded(hadamard32(grouped) if hadamard else grouped, world)  # [world, C]: piece j goes to rank j
    cap = rows.shape[1]
    mine = _exchange(rows, bits, derive_seed(seed, rank, 1), group).sum(dim=0)  # the sum of my piece, float32
    q = quantize(mine.view(1, cap), bits, GRAD_GROUP, "stochastic", seed=derive_seed(seed, rank, 2),
                 check_finite=False)
    codes = _all_gather(q.data.view(-1), group, world).view(-1)
    scales = _all_gather(q.scales.view(-1), group, world).view(-1)
    total = QTensor(codes, scales, (world, cap), torch.float32, bits, GRAD_GROUP).dequantize(torch.float32)
    groups = grouped.numel() // GRAD_GROUP
    base, extra = divmod(groups, world)
    short = base * GRAD_GROUP
    out = total.reshape(-1) if extra == 0 else torch.cat([total[:extra].reshape(-1), total[extra:, :short].reshape(-1)])
    if hadamard:
        out = inverse_hadamard32(out)
    flat.copy_(out[: flat.numel()])
    return tensor


class ReplicaAllReduce:
    """FSDP2's all-reduce hook (`FSDPModule.set_all_reduce_hook`) over the replicas: `reduce_output`, this rank's
    reduce-scattered shard of one unit's gradient, becomes its mean over the R ranks of `group`, all-reduced by
    `kind` ("quangrad8" or "tlq4"; "exact": torch's all-reduce). Build one on every rank; `seed` seeds TLq's
    stochastic rounding (salted with the call count, so every call draws other noise, and a run replays)."""

    def __init__(self, group, kind: str, *, seed: int = 0, hadamard: bool = True):
        if kind not in ALL_REDUCES:
            raise ValueError(f"the replicas' all-reduce must be one of {', '.join(ALL_REDUCES)}, got {kind!r}")
        self.group, self.kind, self.seed, self.hadamard = group, kind, int(seed), hadamard
        self.replicas = dist.get_world_size(group)
        self.calls = 0

    @torch.no_grad()
    def __call__(self, reduce_output: torch.Tensor) -> None:
        if self.replicas == 1:
            return
        self.calls += 1
        if self.kind == "exact":
            dist.all_reduce(reduce_output, group=self.group)
        elif self.kind == "quangrad8":
            from agoq.runtime.comm.quantized_allreduce import quantized_all_reduce

            # every unit is quantized (FSDP2's units are whole decoder layers)
            quantized_all_reduce(reduce_output, self.group, min_numel=0)
        else:
            from agoq.runtime.comm.sdp4bit import derive_seed

            tlq_all_reduce(reduce_output, self.group, hadamard=self.hadamard,
                           seed=derive_seed(self.seed, self.calls))
        reduce_output.div_(self.replicas)


def use_replica_all_reduce(module: torch.nn.Module, hook: ReplicaAllReduce) -> ReplicaAllReduce:
    """Set `hook` as the all-reduce hook of every fully_shard-ed module in `module` (sharded over the 1-D row of
    an HSDP mesh: see the module docstring). Returns it."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"{type(module).__name__} holds no fully_shard-ed module: shard it first")
    for m in modules:
        m.set_all_reduce_hook(hook)
    return hook


__all__ = ["hybrid_mesh", "tlq_all_reduce", "ReplicaAllReduce", "use_replica_all_reduce", "ALL_REDUCES",
           "MESH_DIMS"]
