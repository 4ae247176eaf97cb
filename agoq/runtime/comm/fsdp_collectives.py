"""SDP4Bit's TLq-HS gradient reduce-scatter as a communication of PyTorch's FSDP2 (`fully_shard`).

FSDP2 reduces the gradients of one `fully_shard` unit at a time: it copies them into one flat input of
W * S values laid out as W rows of S (row r holds what rank r will own, padding included) and calls its
reduce-scatter, which must leave in the S-value output the sum over ranks of row `rank`. A subclass of
FSDP2's `ReduceScatter` (`torch.distributed.fsdp._fully_shard._fsdp_api`, torch >= 2.9) set with
`FSDPModule.set_custom_reduce_scatter` replaces that call; FSDP2 still allocates the buffers, runs the
call on its reduce-scatter stream (overlapped with the rest of backward) and writes the output into the
parameters' sharded `.grad`.

`TLQHSReduceScatter` is that call done by `agoq.runtime.comm.sdp4bit.tlq_hs`: each row is padded with zeros to
a multiple of 128 values (S' = 128 * ceil(S / 128)), Hadamard-32 transformed, quantized to int8 codes
with one float32 scale per 128 values (stochastic rounding) and exchanged inside the node, summed in
float32, requantized to int4 across nodes, summed, inverse-transformed; rank r keeps row r's first S
values. It computes a SUM (an AVG when FSDP2 asks for one: the sum divided by the world size):
`use_quantized_reduce_scatter` also sets `set_force_sum_reduction_for_comms(True)` where torch has it, so
FSDP2 divides by the world size (or the factor given to `set_gradient_divide_factor`) after the call, in
float32 when reduce_dtype is float32. Any other reduction (PREMUL_SUM) is refused with what to do.

Error (one level, one node of W ranks, int8): every value of rank r's transformed row in a 128-block b
is rounded by less than one step s_rb = max|block| / 127, so the error of the sum has L2 norm at most
sum_r sqrt(128) / 127 * ||g_r||_2 (the Hadamard transform is orthonormal); stochastic rounding makes it
unbiased, with an expected squared norm at most sum_r sum_b 128 * s_rb**2 / 4.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from agoq.runtime.comm.sdp4bit import GRAD_GROUP, Topology, derive_seed, tlq_hs, topology

try:  # torch >= 2.9 (absent in 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - depends on the installed torch
    _ReduceScatter = None

MIN_TORCH = "2.9"


def _require_protocol() -> None:
    if _ReduceScatter is None:
        raise RuntimeError(f"torch {torch.__version__} has no FSDP2 custom reduce-scatter "
                           "(torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter): agoq's quantized FSDP2 "
                           f"collectives need torch >= {MIN_TORCH}; upgrade torch, or run "
                           "FSDP2's own exact reduce-scatter (--gradients bf16)")


_Base = _ReduceScatter if _ReduceScatter is not None else object


class TLQHSReduceScatter(_Base):
    """FSDP2's gradient reduce-scatter as TLq-HS (int8 inside a node, int4 across, Hadamard-32 first).

    Build it on every rank (it may create node sub-groups, a collective): `group` is the FSDP mesh's
    process group, `node_size` ranks per node (default: torchrun's LOCAL_WORLD_SIZE for the default
    group, else one node), `hadamard` the 32-point transform before quantizing, `seed` the stochastic
    rounding's seed (mixed with the rank, the call count and the level, so every call and rank draws
    other noise; the same seed replays the same run). `lanes` > 1 spreads each exchange over that many
    communicators (more socket connections; same result).
    """

    def __init__(self, group=None, *, node_size: int | None = None, hadamard: bool = True, seed: int = 0,
                 lanes: int = 1):
        _require_protocol()
        self.group = group if group is not None else dist.group.WORLD
        self.topo: Topology = topology(self.group, node_size=node_size)
        self.hadamard, self.seed, self.lanes = hadamard, int(seed), lanes
        self.calls = 0  # reduce-scatters done: salts the rounding noise

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's input and output buffers: plain tensors from the caching allocator."""
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op=dist.ReduceOp.SUM,
                 async_op: bool = False):
        """Write into `output_tensor` (S values) the sum over ranks of row `rank` of `input_tensor` ([W, S] flat)."""
        average = op == dist.ReduceOp.AVG
        if not (average or op == dist.ReduceOp.SUM):
            raise ValueError("TLq-HS computes a sum (or an average): FSDP2 asked for another reduction (a custom "
                             "set_gradient_divide_factor without set_force_sum_reduction_for_comms(True)); call "
                             "set_force_sum_reduction_for_comms(True) on every FSDP module that uses it "
                             "(agoq.use_quantized_reduce_scatter does), so that FSDP2 divides after the reduce-scatter")
        world = self.topo.world
        if group is not None and dist.get_world_size(group) != world:
            raise ValueError(f"FSDP2 reduce-scatters over {dist.get_world_size(group)} ranks but this TLq-HS was built "
                             f"for a group of {world}: build it with the FSDP mesh's group (mesh.get_group())")
        cap = output_tensor.numel()
        if input_tensor.numel() != world * cap:
            raise ValueError(f"reduce-scatter input of {input_tensor.numel()} values for {world} ranks x "
                             f"{cap} output values")
        padded = -(-cap // GRAD_GROUP) * GRAD_GROUP
        rows = input_tensor.view(world, cap)
        if padded != cap or rows.dtype != torch.float32:
            flat = rows.new_zeros(world, padded, dtype=torch.float32)
            flat[:, :cap] = rows
            flat = flat.view(-1)
        else:
            flat = rows.reshape(-1)
        self.calls += 1
        shard = tlq_hs(flat, self.topo, self.hadamard, derive_seed(self.seed, self.calls), self.lanes)
        output_tensor.copy_(shard[:cap].div_(world) if average else shard[:cap])
        return None


def _fsdp_modules(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def use_quantized_reduce_scatter(module: torch.nn.Module, *, group=None, node_size: int | None = None,
                                 hadamard: bool = True, seed: int = 0, lanes: int = 1) -> TLQHSReduceScatter:
    """Make every `fully_shard`-ed module in `module` reduce-scatter its gradients by TLq-HS.

    Call it on every rank after `fully_shard` (per block and the root) and before the first backward.
    Sets one shared `TLQHSReduceScatter` on each FSDP module and `set_force_sum_reduction_for_comms(True)`,
    so FSDP2 divides the summed gradient by the world size afterwards (a factor set by
    `set_gradient_divide_factor` still applies). `group`: the FSDP mesh's group (default: the default
    group). Returns the reduce-scatter.
    """
    _require_protocol()
    modules = _fsdp_modules(module)
    if not modules:
        raise ValueError(f"{type(module).__name__} holds no fully_shard-ed module: call "
                         "torch.distributed.fsdp.fully_shard on its blocks and itself first (or use "
                         "agoq.fully_shard_quantized)")
    comm = TLQHSReduceScatter(group, node_size=node_size, hadamard=hadamard, seed=seed, lanes=lanes)
    for m in modules:
        m.set_custom_reduce_scatter(comm)
        if hasattr(m, "set_force_sum_reduction_for_comms"):  # else FSDP2 asks for SUM or AVG, both handled
            m.set_force_sum_reduction_for_comms(True)
    return comm


__all__ = ["TLQHSReduceScatter", "use_quantized_reduce_scatter", "MIN_TORCH"]
