"""Applying a plan to a model: every transform of a run, in one ordered function.

`apply_plan(model, policy=..., checkpoint=..., run=RunSpec, place=Placement)` runs these steps, each once, in this
order (each is a keyword-only `apply_*` function of its own):

  1. policy         what each decoder layer keeps for backward (LAAQ: bit widths, kept, recomputed kinds)
  2. checkpointing  the layers recomputed whole in backward; it wraps whatever forward step 1 left
  3. compile        torch.compile each decoder layer on its own: it traces the forward steps 1-2 made
  4. offload        where the kept tensors live: chosen layers' saved tensors go to pinned host memory
                    (agoq.runtime.activations.offload); it wraps each layer's call, compiled or not, from outside
  5. parallel       this rank's strategy (agoq.train.parallel, agoq.train.fsdp_strategy) of the run's dims
                    (agoq.parallel_dims), one `apply_*` per dimension in order: `apply_pipeline` cuts this rank's
                    stage; else `apply_shard` shards the state (FSDP2 over replicate x shard -- HSDP with replicas);
                    else `apply_replicate` keeps replicas (DDP; one process)

The activation settings come from a plan (`Plan.activation_policy()`, `Plan.checkpoint_layers()`) or from the
flags (--policy, --checkpoint-all); the rest from the run's settings, one typed `RunSpec` (the plan and the flags
resolved by agoq.train.plan_settings.reconcile), and this process's `Placement`. Steps 1-2 replace
what was applied before (`remove_plan` undoes them); steps 3-5 are for a model that trains next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agoq.runtime.activations import checkpointing
from agoq.runtime.activations.compile import compile_decoder_layers, mark_cudagraph_step
from agoq.runtime.activations.laaq import apply_activation_policy, remove_activation_policy
from agoq.runtime.activations.offload import ActivationOffload, remove_offload
from agoq.runtime.activations.offload import apply_offload as offload_layers
from agoq.runtime.activations.policy import ActivationPolicy
from agoq.parallel_dims import FSDP2_ENGINE, ParallelDims
from agoq.train.data import BatchShape
from agoq.train.fsdp_strategy import FullyShardedDataParallel
from agoq.train.parallel import DataParallel, ParallelStrategy, Pipelined
from agoq.train.plan_settings import RunSpec
from agoq.train.world import World


@dataclass(frozen=True)
class Placement:
    """Where this process runs the plan: its place in the world, its device and dtype, and a pipeline's stage of each
    decoder layer (None: no pipeline). What the run's settings (`RunSpec`) cannot say before the model is built."""

    world: World
    device: torch.device
    dtype: torch.dtype
    layer_stage: list[int] | None = None


@dataclass(frozen=True)
class AppliedPlan:
    """What `apply_plan` made: the strategy that trains the model (None: no parallel step asked), and what the loop
    calls before each training micro-batch (compile's and offload's; nothing when neither applies), and the
    offload (None: none)."""

    strategy: ParallelStrategy | None
    before_micro_batch: Callable[[], None]
    offload: ActivationOffload | None = None


def apply_plan(model: nn.Module, *, policy: ActivationPolicy | None = None, checkpoint: Sequence[int] = (),
               run: RunSpec | None = None, place: Placement | None = None) -> AppliedPlan:
    """Transform `model` as a run's plan says, in the module docstring's order: `policy` (None: every kind kept) and
    `checkpoint` (decoder layer indices), then what the run's settings `run` (agoq.train.plan_settings.RunSpec, the
    plan and the flags resolved; None: eager, no offload, no strategy) say: torch.compile's mode and budget, the
    offloaded layers and their host budget in bytes, and, with `place` (None: no strategy, e.g. to measure what a
    layer keeps), the parallel strategy of the run's dims with its gradient storage, batch shape, optimizer and
    masters."""
    apply_policy(model, policy=policy)
    apply_checkpointing(model, layers=checkpoint)
    compiled_step = apply_compile(model, mode=None if run is None else run.torch_compile_mode,
                                  memory_budget=None if run is None else run.activation_memory_budget)
    offloaded = None if run is None else apply_offload(model, layers=run.offload.layers,
                                                       host_budget_bytes=run.offload.host_budget_bytes)
    before_micro_batch = compiled_step
    if offloaded is not None:
        def before_micro_batch():
            compiled_step()
            offloaded.begin_micro_batch()
    strategy = None
    if run is not None and place is not None:
        strategy = apply_parallel(
            model, dims=run.layout.dims, world=place.world, device=place.device, gradients=run.gradients,
            dtype=place.dtype, shape=run.shape, layer_stage=place.layer_stage, optimizer=run.cfg.optim.optimizer,
            master=run.cfg.optim.master, weight_gather=run.cfg.parallelism.weight_gather)
    return AppliedPlan(strategy, before_micro_batch, offloaded)


def apply_policy(model: nn.Module, *, policy: ActivationPolicy | None) -> None:
    """Step 1: `policy` on every decoder layer (None: each runs its own forward). Replaces the policy and the
    checkpointing applied before (checkpointing wraps the policy's forward, so it is undone first)."""
    checkpointing.remove_checkpointing(model)
    if policy is None:
        remove_activation_policy(model)
    else:
        apply_activation_policy(model, policy)


def apply_checkpointing(model: nn.Module, *, layers: Sequence[int]) -> None:
    """Step 2: recompute decoder layers `layers` whole in backward (each then keeps only its input)."""
    if layers:
        checkpointing.apply_checkpointing(model, list(layers))


def apply_offload(model: nn.Module, *, layers: Sequence[int],
                  host_budget_bytes: int | None = None) -> ActivationOffload | None:
    """Step 4: what decoder layers `layers` save for backward (what steps 1-2 chose to keep, as the code of step 3
    keeps it) goes to pinned host memory, at most `host_budget_bytes` of it (None: no cap). Returns the offload
    (None: no layer offloads; any offload applied before is undone)."""
    return offload_layers(model, layers=layers, host_budget_bytes=host_budget_bytes)


def _nothing() -> None:
    pass


def apply_compile(model: nn.Module, *, mode: str | None, memory_budget: float | None = None) -> Callable[[], None]:
    """Step 3: torch.compile each decoder layer on its own in `mode` (None: eager, nothing changes), its partitioner
    keeping about `memory_budget` of the activations (torch._functorch.config.activation_memory_budget, a setting
    of the process; None: 1, all it would keep). Returns what the loop calls before each training micro-batch:
    under CUDA graphs, that the last one's outputs are done with."""
    if mode is None:
        if memory_budget is not None:
            raise ValueError("an activation memory budget is torch.compile's: it needs a compile mode")
        return _nothing
    torch._functorch.config.activation_memory_budget = 1.0 if memory_budget is None else float(memory_budget)
    compile_decoder_layers(model, mode=mode)
    return lambda: mark_cudagraph_step(mode)


def apply_parallel(model: nn.Module, *, dims: ParallelDims, world: World, device: torch.device, gradients: str,
                   dtype: torch.dtype, shape: BatchShape, layer_stage: list[int] | None = None,
                   optimizer: str = "adamw", master: str = "fp32", weight_gather: str = "bf16") -> ParallelStrategy:
    """Step 5: this rank's strategy for the run's `dims` (checked against the world), one dimension at a time, in
    order: pipeline stages, then the data ranks, sharded (shard, with its replicas) or replicated. `gradients` is
    the gradient storage, `shape` the batch shape (a pipeline's schedule), `layer_stage` a pipeline's stage of each
    decoder layer, `optimizer` and `master` what FSDP2's shards hold, `weight_gather` FSDP2's weight all-gather."""
    dims.validate(world.size)
    if dims.pipeline > 1:
        return apply_pipeline(model, world=world, device=device, gradients=gradients, layer_stage=layer_stage,
                              shape=shape, dtype=dtype)
    if dims.sharded:
        return apply_shard(model, dims=dims, world=world, device=device, gradients=gradients, dtype=dtype,
                           optimizer=optimizer, master=master, weight_gather=weight_gather)
    return apply_replicate(model, world=world, device=device, gradients=gradients)


def apply_pipeline(model: nn.Module, *, world: World, device: torch.device, gradients: str,
                   layer_stage: list[int] | None, shape: BatchShape, dtype: torch.dtype) -> ParallelStrategy:
    """One pipeline stage per rank (1F1B over `shape.grad_accum` micro-batches): this rank keeps its decoder layers
    (`layer_stage`) and the embeddings or head its stage needs."""
    if layer_stage is None:
        raise ValueError("a pipeline needs the stage of each decoder layer (Placement.layer_stage)")
    return Pipelined(model, world=world, device=device, gradients=gradients, layer_stage=layer_stage,
                     micro_batch=shape.micro_batch, seq_len=shape.seq_len, grad_accum=shape.grad_accum, dtype=dtype)


def apply_shard(model: nn.Module, *, dims: ParallelDims, world: World, device: torch.device, gradients: str,
                dtype: torch.dtype, optimizer: str = "adamw", master: str = "fp32",
                weight_gather: str = "bf16") -> ParallelStrategy:
    """The state sharded over `dims.shard` ranks by `dims.engine`, FSDP2 (with `dims.replicate` > 1, HSDP: replicas
    of the shards across nodes; `dims.ranks_per_node`: TLq-HS's node). agoq's own sharded step was retired."""
    if dims.engine != FSDP2_ENGINE:
        raise ValueError(f"parallel.engine {dims.engine!r}: the state is sharded by {FSDP2_ENGINE} only")
    return FullyShardedDataParallel(model, world=world, device=device, gradients=gradients, dtype=dtype,
                                    replicate=dims.replicate, node_size=dims.ranks_per_node, optimizer=optimizer,
                                    master=master, weight_gather=weight_gather)


def apply_replicate(model: nn.Module, *, world: World, device: torch.device, gradients: str) -> ParallelStrategy:
    """Replicas of the whole state on every rank (DDP; one process when the world is one rank)."""
    if world.size > 1:
        return DataParallel(model, world=world, device=device, gradients=gradients)
    return ParallelStrategy(model, world=world, device=device, gradients=gradients)


def remove_plan(model: nn.Module) -> None:
    """Undo steps 1-2 and 4 of `apply_plan`: no activation policy, no checkpointing, no offload."""
    remove_offload(model)
    checkpointing.remove_checkpointing(model)
    remove_activation_policy(model)


__all__ = ["apply_plan", "apply_policy", "apply_checkpointing", "apply_offload", "apply_compile", "apply_parallel",
           "apply_pipeline", "apply_shard", "apply_replicate",
           "remove_plan", "AppliedPlan", "Placement"]
