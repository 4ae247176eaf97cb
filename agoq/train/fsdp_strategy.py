"""`--parallel fsdp` and `--parallel hsdp`: PyTorch's FSDP2, one `fully_shard` unit per decoder layer and one for the
rest, over the run's replicate x shard dims (agoq.parallel_dims; replicate 1: FSDP over every rank, a 1-D mesh;
replicate R > 1: HSDP, a 2-D mesh of R nodes of `shard` ranks each, agoq.runtime.comm.hsdp).

The sharded parameters are float32 (the optimizer's masters, 1/shard per rank) and the layers compute in `dtype`
(FSDP2's MixedPrecisionPolicy: weights all-gathered in `dtype`), except with --optimizer adamw8bit --master none,
where the shards stay in `dtype` and the 8-bit optimizer rounds its float32 update stochastically into them.

Gradients, per --gradients:

  bf16       FSDP2's own: reduce-scattered in `dtype` within the shard ranks, and with replicas all-reduced across
             them by FSDP2's native HSDP (deferred to the last micro-batch: `set_requires_all_reduce`)
  sdp4bit    reduce-scattered from float32 by SDP4Bit's TLq-HS (fsdp: int8 inside a node of `node_size` ranks, int4
             across; hsdp: int8 within the node), and with replicas all-reduced across nodes in 4 bits (TLq)
  quangrad8  hsdp only: FSDP2's exact reduce-scatter (float32) within the node, QuanGrad's 8-bit all-reduce across

`weight_gather` "int8" (or "int4") all-gathers the weight matrices as block codes and scales instead of `dtype`
(agoq.runtime.comm.fsdp_weight_gather, ZeRO++'s qwZ), within the shard ranks. The activation plan or policy was
applied to the layers before they were sharded; checkpoints hold the DTensor shards, each replicated one once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from agoq.layout import FSDP, HSDP
from agoq.train.config import OptimizerConfig
from agoq.train.optimizer import OptimizerStep, build_fsdp_optimizer
from agoq.train.parallel import ParallelStrategy, _broadcast_from_rank0, _LossModule
from agoq.train.world import World

# --gradients -> how the replicas of HSDP all-reduce (agoq.runtime.comm.hsdp.ALL_REDUCES)
REPLICA_ALL_REDUCE = {"bf16": "exact", "quangrad8": "quangrad8", "sdp4bit": "tlq4"}


class FullyShardedDataParallel(ParallelStrategy):
    """FSDP2 over `replicate` x world / `replicate` ranks (see the module docstring)."""

    def __init__(self, model: nn.Module, *, world: World, device: torch.device, gradients: str, dtype: torch.dtype,
                 replicate: int = 1, node_size: int | None, optimizer: str, master: str, weight_gather: str = "bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from agoq.runtime.comm.fsdp import default_mesh, fully_shard_quantized
        from agoq.runtime.comm.fsdp_collectives import _require_protocol
        from agoq.runtime.comm.hsdp import hybrid_mesh

        if world.size % replicate:
            raise ValueError(f"{replicate} replicas do not divide the world's {world.size} ranks")
        self.replicas = replicate
        self.mode = HSDP if replicate > 1 else FSDP
        if gradients == "quangrad8" and replicate == 1:
            raise ValueError("--gradients quangrad8 all-reduces HSDP's replicas in 8 bits: it needs --parallel hsdp "
                             "(FSDP's reduce-scatter is bf16 or sdp4bit)")
        _require_protocol()  # FSDP2's custom reduce-scatter (torch >= 2.9): a clear message before anything is sharded
        if world.size > 1:
            _broadcast_from_rank0(model)
        keep_dtype = optimizer == "adamw8bit" and master == "none"
        mp_policy = None
        if dtype != torch.float32 and not keep_dtype:
            for p in model.parameters():  # float32 shards: the optimizer's masters
                p.data = p.data.float()
            mp_policy = MixedPrecisionPolicy(param_dtype=dtype,
                                             reduce_dtype=torch.float32 if gradients != "bf16" else None)
        mesh = hybrid_mesh(device, replicate, world.size // replicate) if replicate > 1 else default_mesh(device)
        self.shard_group = mesh[mesh.mesh_dim_names[-1]].get_group() if replicate > 1 else None
        self.native_hsdp = replicate > 1 and gradients == "bf16"
        self.loss_module = _LossModule(model)  # the root unit: embeddings, final norm and head
        fully_shard_quantized(self.loss_module, mesh=mesh, mp_policy=mp_policy,
                              reduce_scatter="tlq-hs" if gradients == "sdp4bit" else "exact",
                              node_size=node_size if replicate == 1 else None,
                              all_gather="exact" if weight_gather == "bf16" else weight_gather,
                              all_reduce=REPLICA_ALL_REDUCE[gradients] if replicate > 1 else "exact")
        super().__init__(model, world=world, device=device, gradients="bf16")

    def build_optimizer(self, optim: OptimizerConfig, seed: int) -> OptimizerStep:
        return build_fsdp_optimizer(self.params, optim, seed=seed, device=self.device)

    def _loss(self, ids: torch.Tensor, labels: torch.Tensor, last: bool) -> torch.Tensor:
        if self.native_hsdp:  # FSDP2 sums the micro-batches' shards and all-reduces them across nodes once
            self.loss_module.set_requires_all_reduce(last)
        return self.loss_module(ids, labels)  # every micro-batch's gradients are reduce-scattered into the shards

    def gradients(self, fused: bool):
        """The parameters' sharded gradients (DTensors; zeros where a parameter got none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def norm_tensors(self, grads):
        return [g.to_local() for g in grads]  # FSDP2's shards are disjoint (padding excluded)

    def reduce_grad_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(sq, group=self.shard_group)  # over one node's shards: every replica holds the same
        return sq

    def _validation_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_module(ids, labels).float()


__all__ = ["FullyShardedDataParallel", "REPLICA_ALL_REDUCE"]
