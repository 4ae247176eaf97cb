"""A model sharded by PyTorch's FSDP2 (`fully_shard`), one unit per block and one for the rest, with agoq's
quantized gradient reduce-scatter.

`fully_shard_quantized(model, mesh=...)` is what a user's own FSDP2 script does by hand: `fully_shard` each
block (default: the LLaMA-style decoder layers), then the root, on a 1-D `DeviceMesh`, with a
`MixedPrecisionPolicy`; then, with reduce_scatter="tlq-hs", every unit's gradient reduce-scatter becomes
SDP4Bit's TLq-HS (`agoq.runtime.comm.fsdp_collectives`). The parameters stay FSDP2's sharded DTensors: any optimizer
over `model.parameters()`, `torch.distributed.checkpoint`, gradient clipping with
`torch.nn.utils.clip_grad_norm_` and the rest of FSDP2 work as without agoq.

The weight all-gather is FSDP2's own (in `mp_policy.param_dtype`) with all_gather="exact", or ZeRO++'s qwZ with
"int8" (block-wise int8 codes and float32 scales, `agoq.runtime.comm.fsdp_weight_gather`, through FSDP2's all-gather
hooks; "int4": 4-bit codes after a Hadamard-32 transform). SDP4Bit's 4-bit weight-difference all-gather (qWD)
needs the previous full weights on every rank, which FSDP2 does not keep (agoq.runtime.comm.sdp4bit has it as a
library piece).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

REDUCE_SCATTERS = ("tlq-hs", "exact")
ALL_GATHERS = ("exact", "int8", "int4")


def default_mesh(device: torch.device | str):
    """A 1-D DeviceMesh over every rank of the default process group, on `device`'s type."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("FSDP2 needs torch.distributed: launch under torchrun (or call "
                           "dist.init_process_group) before sharding the model")
    return init_device_mesh(torch.device(device).type, (dist.get_world_size(),))


def fully_shard_quantized(model: nn.Module, *, mesh=None, blocks: Sequence[nn.Module] | None = None,
                          mp_policy=None, reduce_scatter: str = "tlq-hs", all_gather: str = "exact",
                          node_size: int | None = None, hadamard: bool = True, seed: int = 0,
                          reshard_after_forward: bool = True, gather_block: int | None = None,
                          all_reduce: str = "exact") -> nn.Module:
    """Shard `model` with FSDP2, each of `blocks` and then the root as its own unit; returns `model`.

    mesh: a 1-D DeviceMesh (default: every rank of the default group, on the parameters' device type), or HSDP's
    2-D one (`agoq.runtime.comm.hsdp.hybrid_mesh`: replicate x shard): shards within its rows, and `all_reduce`
    says how the replicas' gradients are all-reduced: "exact" (FSDP2's native HSDP), "quangrad8" or "tlq4"
    (agoq.runtime.comm.hsdp.ReplicaAllReduce, FSDP2's all-reduce hook; the units are then sharded over the row).
    blocks: the modules to shard one by one (default: the decoder layers, modules with self_attn, mlp,
    input_layernorm and post_attention_layernorm); apply activation policies and checkpointing to them
    before calling this. mp_policy: FSDP2's MixedPrecisionPolicy (e.g. param_dtype=torch.bfloat16 with
    float32 parameters: bf16 compute, float32 sharded weights for the optimizer). reduce_scatter:
    "tlq-hs" (int8 inside a node, int4 across, Hadamard-32 when `hadamard`; `node_size` ranks per node,
    default torchrun's LOCAL_WORLD_SIZE, the whole row of a 2-D mesh; `seed` seeds its stochastic rounding) or
    "exact" (FSDP2's own).
    all_gather: "exact" (FSDP2's, in param_dtype), "int8" or "int4" (every weight matrix gathered as block
    codes, one float32 scale per `gather_block` values, default 256; `agoq.runtime.comm.fsdp_weight_gather`). Every
    rank must call it, on the same model, after any change of the parameters' dtype.
    """
    from torch.distributed.fsdp import fully_shard

    if reduce_scatter not in REDUCE_SCATTERS:
        raise ValueError(f"reduce_scatter must be one of {', '.join(REDUCE_SCATTERS)}, got {reduce_scatter!r}")
    if all_gather not in ALL_GATHERS:
        raise NotImplementedError(f"all_gather={all_gather!r}: inside FSDP2 the weight all-gather is one of "
                                  f"{', '.join(ALL_GATHERS)}; SDP4Bit's 4-bit weight differences (qWD) need "
                                  "every rank's previous full weights, which FSDP2 does not keep: use int4")
    if reduce_scatter == "tlq-hs":
        from agoq.runtime.comm.fsdp_collectives import _require_protocol

        _require_protocol()  # before anything is sharded
    if mesh is None:
        first = next(model.parameters(), None)
        if first is None:
            raise ValueError(f"{type(model).__name__} has no parameters to shard")
        mesh = default_mesh(first.device)
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard_quantized shards over a 1-D DeviceMesh (FSDP) or a 2-D one (HSDP: "
                         f"replicate x shard), got {mesh.ndim} dimensions")
    from agoq.runtime.comm.hsdp import ALL_REDUCES

    if all_reduce not in ALL_REDUCES:
        raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {all_reduce!r}")
    if all_reduce != "exact" and mesh.ndim != 2:
        raise ValueError(f"all_reduce={all_reduce!r} all-reduces the replicas of HSDP: give a 2-D mesh "
                         "(agoq.runtime.comm.hsdp.hybrid_mesh)")
    hooked = mesh.ndim == 2 and all_reduce != "exact"
    shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]
    if blocks is None:
        from agoq.runtime.activations.saved_bytes import find_decoder_layers

        blocks = find_decoder_layers(model)
    if all_gather != "exact":
        from agoq.runtime.comm.fsdp_weight_gather import DEFAULT_BLOCK, apply_weight_gather

        apply_weight_gather(model, bits=8 if all_gather == "int8" else 4, block=gather_block or DEFAULT_BLOCK)
    kwargs = {"mesh": shard_mesh if hooked else mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if all_gather != "exact":
        _settle_local_shards(model)
    if reduce_scatter == "tlq-hs":
        from agoq.runtime.comm.fsdp_collectives import use_quantized_reduce_scatter

        rows = shard_mesh.size()  # a row of a 2-D mesh is one node (int8 only)
        use_quantized_reduce_scatter(model, group=shard_mesh.get_group(), node_size=rows if mesh.ndim == 2
                                     else node_size, hadamard=hadamard, seed=seed)
    if hooked:
        from agoq.runtime.comm.hsdp import ReplicaAllReduce, use_replica_all_reduce

        use_replica_all_reduce(model, ReplicaAllReduce(mesh[mesh.mesh_dim_names[0]].get_group(), all_reduce,
                                                       seed=seed + 1, hadamard=hadamard))
    return model


def _settle_local_shards(model: nn.Module) -> None:
    """Run FSDP2's per-unit lazy initialisation now rather than at the first forward. For a parameter whose
    local tensor is a subclass (agoq's gather wrapper) and whose shard is padded, that initialisation copies the
    shard into a new padded tensor and swaps the DTensor's local tensor: done here, an optimizer built after
    `fully_shard_quantized` holds the local tensors FSDP2 keeps (agoq's fused 8-bit AdamW captures them)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None and hasattr(group, "lazy_init"):
                group.lazy_init()


__all__ = ["fully_shard_quantized", "default_mesh", "REDUCE_SCATTERS", "ALL_GATHERS"]
