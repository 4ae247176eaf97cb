"""The process group and one strategy per parallel mode: what differs between one process, DDP, sharded and pipeline.

`apply_parallel(model, mode=...)` returns the strategy of this rank. It owns the module this rank trains and
checkpoints (the whole model, or a pipeline stage), the gradient storage (QuanGrad's 8-bit buffer or the
parameters' .grad), and every step of the loop that differs per mode: the forward and backward of a step's
micro-batches, the reduction of the gradients, of the squared gradient norm and of a value over the ranks,
the validation loss and, for sharded runs, the optimizer (SDP4Bit's sharded AdamW). The loop
(`agoq.train.trainer`) calls it without asking which mode it is.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from agoq.layout import DDP, FSDP, NONE, PIPELINE, SHARDED
from agoq.models.lm_loss import chunked_lm_loss
from agoq.train.config import OptimizerConfig
from agoq.train.data import Batches
from agoq.train.optimizer import OptimizerStep, build_fsdp_optimizer, build_optimizer, build_sharded_optimizer

# --------------------------------------------------------------------------------------- world


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    backend: str | None = None
    initialised_here: bool = False

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def gather_ints(self, value: int, device: torch.device) -> list[int]:
        """`value` of every rank, in rank order."""
        if self.size == 1:
            return [value]
        dev = device if self.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([value], dtype=torch.int64, device=dev)
        out = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine)
        return [int(t) for t in out]

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when `flag` is true on at least one (one small all-reduce; every rank calls it)."""
        if self.size == 1:
            return bool(flag)
        dev = device if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def join_world(device_hint: str | None) -> World:
    """The process group: the existing one, one from torchrun's environment, or a single process."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                     int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), dist.get_backend())
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    use_cuda = torch.cuda.is_available() and (device_hint is None or device_hint.startswith("cuda"))
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return World(dist.get_rank(), dist.get_world_size(), local_rank,
                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")), backend, True)


# --------------------------------------------------------------------------------------- strategies


class _LossModule(nn.Module):
    """model + chunked loss as one module, so DDP sees one forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return chunked_lm_loss(self.model.model(input_ids), self.model.lm_head.weight, labels)


def _model_loss(module: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return chunked_lm_loss(module.model(ids), module.lm_head.weight, labels)


class ParallelStrategy:
    """One process (`--parallel none`); the base of the others, which override what differs."""

    mode = NONE
    overlaps_quantized_reduce = False  # QuanGrad reduces its buckets during the last micro-batch's backward

    def __init__(self, module: nn.Module, *, world: World, device: torch.device, gradients: str):
        self.module = module  # what this rank trains and checkpoints
        self.world, self.device = world, device
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.qgrads = None
        if gradients == "quangrad8":
            from agoq.runtime.comm.quangrad import QuantizedGradients

            self.qgrads = QuantizedGradients(self.params, overlap=self.overlaps_quantized_reduce)

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data (tokens per step = batch shape x this)."""
        return self.world.size

    @property
    def pipeline_stages(self) -> int:
        return 1

    def build_optimizer(self, optim: OptimizerConfig, seed: int) -> OptimizerStep:
        return build_optimizer(self.params, optim, seed=seed, device=self.device)

    def release(self) -> None:
        """Remove the hooks this strategy put on the model's parameters (QuanGrad's capture), so that the model, its
        gradient buffer and the optimizer can be freed when the run is dropped (a hook holding the parameter it
        hangs on is a reference cycle through autograd that Python's collector cannot break)."""
        if self.qgrads is not None:
            self.qgrads.remove()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.qgrads is not None:
            self.qgrads.zero_()

    # ---------------------------------------------------------------- forward and backward

    def forward_backward(self, batches: Batches, step: int, grad_accum: int,
                         before_micro_batch: Callable[[], None]) -> torch.Tensor:
        """Every micro-batch of `step`: returns this rank's mean loss (a float32 tensor; 0 where it has none)."""
        total = torch.zeros((), device=self.device)
        for micro in range(grad_accum):
            before_micro_batch()
            ids, labels = batches.micro(step, micro, self.world.rank)
            ids, labels = ids.to(self.device), labels.to(self.device)
            loss = self._loss(ids, labels, last=micro == grad_accum - 1)
            (loss / grad_accum).backward()
            total += loss.detach().float() / grad_accum
        return total

    def _loss(self, ids: torch.Tensor, labels: torch.Tensor, last: bool) -> torch.Tensor:
        return _model_loss(self.module, ids, labels)

    # ---------------------------------------------------------------- reductions

    def gradients(self, fused: bool):
        """After backward: the gradients the optimizer will use (all-reduced where that is needed): float
        tensors, or for the fused step with QuanGrad the QuantizedGradients themselves (no float copy)."""
        if self.qgrads is not None:
            self._reduce_quantized()
            if fused:
                return self.qgrads
            return [self.qgrads.gradient(p) for p in self.params]
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def _reduce_quantized(self) -> None:
        """QuanGrad's gradients after backward: nothing to reduce in one process."""

    def grad_norm(self, grads, fused: bool) -> float:
        """L2 norm of the gradient the optimizer applies (`gradients`' result): with several data-parallel
        ranks, of the gradient averaged over them, as reduced. Each tensor's norm in float32, their squares
        summed in float64 (the fused step: one reduction over the stored gradients), then over the ranks."""
        grads = self.norm_tensors(grads)
        if fused:
            from agoq.runtime.optim.fused_adamw import grad_norm_sq

            sq = grad_norm_sq(grads)
        else:
            norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32) if grads else []
            sq = torch.stack(norms).double().square().sum() if norms else torch.zeros((), dtype=torch.float64,
                                                                                       device=self.device)
        return float(self.reduce_grad_norm_sq(sq).sqrt())

    def norm_tensors(self, grads):
        """What this rank's part of the norm is taken over: `grads` as plain tensors (QuanGrad's stored
        gradients for the fused step)."""
        return grads

    def reduce_grad_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """This rank's squared gradient norm -> the run's."""
        return sq

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.world.size == 1:
            return float(value)
        v = value.detach().float().reshape(1).clone()
        dist.all_reduce(v)
        return float(v) / self.world.size

    # ---------------------------------------------------------------- validation

    @torch.no_grad()
    def evaluate(self, batches: Batches, eval_batches: int) -> float:
        """Mean validation loss over the fixed validation batches."""
        self.module.eval()
        losses = []
        for ids, labels in batches.validation(eval_batches):
            losses.append(self._validation_loss(ids.to(self.device), labels.to(self.device)))
        self.module.train()
        return self._validation_mean(torch.stack(losses).mean())

    def _validation_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _model_loss(self.module, ids, labels).float()

    def _validation_mean(self, mean: torch.Tensor) -> float:
        return float(mean)  # every data-parallel rank holds the same weights and batches


def _broadcast_from_rank0(model: nn.Module) -> None:
    for p in model.parameters():  # every replica starts from rank 0's weights
        dist.broadcast(p.data, 0)


class DataParallel(ParallelStrategy):
    """`--parallel ddp`: replicas; bf16 gradients all-reduced by torch's DDP, QuanGrad's by its 8-bit all-reduce."""

    mode = DDP

    def __init__(self, model: nn.Module, *, world: World, device: torch.device, gradients: str):
        self.overlaps_quantized_reduce = world.size > 1
        if world.size > 1:
            _broadcast_from_rank0(model)
        super().__init__(model, world=world, device=device, gradients=gradients)
        self.ddp = None
        if gradients == "bf16":
            self.ddp = nn.parallel.DistributedDataParallel(_LossModule(model),
                                                           device_ids=[device.index] if device.type == "cuda" else None)

    def _loss(self, ids: torch.Tensor, labels: torch.Tensor, last: bool) -> torch.Tensor:
        if last and self.qgrads is not None and self.world.size > 1:
            self.qgrads.prepare_sync()  # buckets all-reduce during this backward
        if self.ddp is None:
            return _model_loss(self.module, ids, labels)
        if last:
            return self.ddp(ids, labels)
        with self.ddp.no_sync():
            return self.ddp(ids, labels)

    def _reduce_quantized(self) -> None:
        self.qgrads.all_reduce(average=True)


class Sharded(ParallelStrategy):
    """`--parallel sharded`: SDP4Bit's sharded AdamW reduces the local gradients (int8/int4, or exactly)."""

    mode = SHARDED

    def __init__(self, model: nn.Module, *, world: World, device: torch.device, gradients: str, node_size: int | None):
        if world.size > 1:
            _broadcast_from_rank0(model)
        super().__init__(model, world=world, device=device, gradients=gradients)
        self.quantized = gradients == "sdp4bit"
        self.node_size = node_size

    def build_optimizer(self, optim: OptimizerConfig, seed: int) -> OptimizerStep:
        self.optimizer_step = build_sharded_optimizer(self.params, optim, seed=seed, quantized=self.quantized,
                                                      node_size=self.node_size)
        return self.optimizer_step

    def gradients(self, fused: bool):
        """This rank's shard of the averaged gradient, reduce-scattered (TLq-HS or exactly) by the optimizer."""
        return self.optimizer_step.reduce(super().gradients(fused))

    def reduce_grad_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        if self.world.size > 1:
            dist.all_reduce(sq)  # disjoint shards of the reduced gradient: the squares add up
        return sq


class FullyShardedDataParallel(ParallelStrategy):
    """`--parallel fsdp`: PyTorch's FSDP2, one `fully_shard` unit per decoder layer and one for the rest.

    The sharded parameters are float32 (the optimizer's masters, 1/N per rank) and the layers compute in
    `dtype` (FSDP2's MixedPrecisionPolicy: weights all-gathered in `dtype`), except with
    --optimizer adamw8bit --master none, where the shards stay in `dtype` and the 8-bit optimizer rounds
    its float32 update stochastically into them. Gradients are reduce-scattered by FSDP2 in `dtype`
    (--gradients bf16) or by SDP4Bit's TLq-HS from float32 (--gradients sdp4bit, int8 inside a node of
    `node_size` ranks, int4 across). `weight_gather` "int8" (or "int4") all-gathers the weight matrices as block
    codes and scales instead of `dtype` (agoq.runtime.comm.fsdp_weight_gather, ZeRO++'s qwZ). The activation plan or policy was applied to the layers before they
    were sharded; checkpoints hold each rank's DTensor shards.
    """

    mode = FSDP

    def __init__(self, model: nn.Module, *, world: World, device: torch.device, gradients: str, dtype: torch.dtype,
                 node_size: int | None, optimizer: str, master: str, weight_gather: str = "bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from agoq.runtime.comm.fsdp import default_mesh, fully_shard_quantized
        from agoq.runtime.comm.fsdp_collectives import _require_protocol

        _require_protocol()  # FSDP2's custom reduce-scatter (torch >= 2.9): a clear message before anything is sharded
        if world.size > 1:
            _broadcast_from_rank0(model)
        keep_dtype = optimizer == "adamw8bit" and master == "none"
        mp_policy = None
        if dtype != torch.float32 and not keep_dtype:
            for p in model.parameters():  # float32 shards: the optimizer's masters
                p.data = p.data.float()
            mp_policy = MixedPrecisionPolicy(param_dtype=dtype,
                                             reduce_dtype=torch.float32 if gradients == "sdp4bit" else None)
        self.loss_module = _LossModule(model)  # the root unit: embeddings, final norm and head
        fully_shard_quantized(self.loss_module, mesh=default_mesh(device), mp_policy=mp_policy,
                              reduce_scatter="tlq-hs" if gradients == "sdp4bit" else "exact", node_size=node_size,
                              all_gather="exact" if weight_gather == "bf16" else weight_gather)
        super().__init__(model, world=world, device=device, gradients="bf16")

    def build_optimizer(self, optim: OptimizerConfig, seed: int) -> OptimizerStep:
        return build_fsdp_optimizer(self.params, optim, seed=seed, device=self.device)

    def _loss(self, ids: torch.Tensor, labels: torch.Tensor, last: bool) -> torch.Tensor:
        return self.loss_module(ids, labels)  # every micro-batch's gradients are reduce-scattered into the shards

    def gradients(self, fused: bool):
        """The parameters' sharded gradients (DTensors; zeros where a parameter got none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def norm_tensors(self, grads):
        return [g.to_local() for g in grads]  # FSDP2's shards are disjoint (padding excluded)

    def reduce_grad_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(sq)
        return sq

    def _validation_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_module(ids, labels).float()


class Pipelined(ParallelStrategy):
    """`--parallel pipeline`: one stage per rank under the 1F1B schedule; one stacked batch per step."""

    mode = PIPELINE

    def __init__(self, model: nn.Module, *, world: World, device: torch.device, gradients: str,
                 layer_stage: list[int], micro_batch: int, seq_len: int, grad_accum: int, dtype: torch.dtype):
        from agoq.train.pipeline import Pipeline

        self.pipeline = Pipeline(model, layer_stage, world.rank, world.size, grad_accum, device, micro_batch, seq_len,
                                 dtype)
        self.hidden_size, self.dtype = model.config.hidden_size, dtype
        super().__init__(self.pipeline.module, world=world, device=device, gradients=gradients)

    @property
    def data_ranks(self) -> int:
        return 1

    @property
    def pipeline_stages(self) -> int:
        return self.world.size

    def forward_backward(self, batches: Batches, step: int, grad_accum: int,
                         before_micro_batch: Callable[[], None]) -> torch.Tensor:
        ids, labels = batches.micro(step, 0)
        loss = self.pipeline.step(ids.to(self.device), labels.to(self.device))
        if self.qgrads is not None:
            # the schedule averages the micro-batches' gradients by dividing each .grad after the last backward;
            # QuanGrad has moved them into its buffer by then, where they are summed
            self.qgrads.scale_(1 / grad_accum)
        return loss if loss is not None else torch.zeros((), device=self.device)

    def reduce_grad_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(sq)  # each stage holds its own parameters
        return sq

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        v = value.detach().float().reshape(1).clone()
        dist.all_reduce(v)
        return float(v)  # only the last stage contributed

    def _validation_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.pipeline.evaluate(ids, labels, self.hidden_size, self.dtype)
        return loss if loss is not None else torch.zeros((), device=self.device)

    def _validation_mean(self, mean: torch.Tensor) -> float:
        return self.mean_over_ranks(mean)


def apply_parallel(model: nn.Module, *, mode: str, world: World, device: torch.device, gradients: str,
                   dtype: torch.dtype, micro_batch: int, seq_len: int, grad_accum: int,
                   layer_stage: list[int] | None = None, node_size: int | None = None, optimizer: str = "adamw",
                   master: str = "fp32", weight_gather: str = "bf16") -> ParallelStrategy:
    """This rank's strategy for `mode` (one of agoq.layout.MODES), wrapping or cutting `model` as the mode needs:
    the last step of applying a plan (agoq.train.apply.apply_plan). `weight_gather` (bf16, int8, int4) is fsdp's."""
    if mode == PIPELINE:
        return Pipelined(model, world=world, device=device, gradients=gradients, layer_stage=layer_stage,
                         micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, dtype=dtype)
    if mode == FSDP:
        return FullyShardedDataParallel(model, world=world, device=device, gradients=gradients, dtype=dtype,
                                        node_size=node_size, optimizer=optimizer, master=master,
                                        weight_gather=weight_gather)
    if mode == SHARDED:
        return Sharded(model, world=world, device=device, gradients=gradients, node_size=node_size)
    if mode == DDP:
        return DataParallel(model, world=world, device=device, gradients=gradients)
    if mode == NONE:
        return ParallelStrategy(model, world=world, device=device, gradients=gradients)
    raise ValueError(f"unknown parallel mode {mode!r}")


__all__ = ["World", "join_world", "apply_parallel", "ParallelStrategy", "DataParallel", "Sharded",
           "FullyShardedDataParallel", "Pipelined"]
