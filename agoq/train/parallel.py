"""One strategy per way of sharing the work: what differs between one process, DDP and pipeline (FSDP2 and HSDP:
agoq.train.fsdp_strategy).

`agoq.train.apply.apply_parallel(model, dims=...)` returns the strategy of this rank (World and join_world, the
process group, live in agoq.train.world). It owns the module this rank trains and
checkpoints (the whole model, or a pipeline stage), the gradient storage (QuanGrad's 8-bit buffer or the
parameters' .grad), and every step of the loop that differs per mode: the forward and backward of a step's
micro-batches, the reduction of the gradients, of the squared gradient norm and of a value over the ranks,
the validation loss and, for FSDP2, the optimizer over its sharded parameters. The loop
(`agoq.train.trainer`) calls it without asking which mode it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from agoq.layout import DDP, NONE, PIPELINE
from agoq.models.lm_loss import chunked_lm_loss
from agoq.train.config import OptimizerConfig
from agoq.train.data import Batches
from agoq.train.optimizer import OptimizerStep, build_optimizer
from agoq.train.world import World, join_world

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


__all__ = ["World", "join_world", "ParallelStrategy", "DataParallel", "Pipelined"]
