"""Applying a plan to a model: every transform of a run, in one ordered function.

`apply_plan(model, policy=..., checkpoint=..., run=RunSpec, place=Placement)` runs these steps, each once, in this
order (each is a keyword-only `apply_*` function of its own):

  1. policy         what each decoder layer keeps for backward (LAAQ: bit widths, kept, recomputed kinds)
  2. checkpointing  the layers recomputed whole in backward; it wraps whatever forward step 1 left
  3. compile        torch.compile each decoder layer on its own: it traces the forward steps 1-2 made
  4. offload        where the kept tensors live: chosen layers' saved tensors go to pinned host memory
                    (agoq.runtime.activations.offload); it wraps each layer's call, compiled or not, from outside
  5. parallel       this rank's strategy (agoq.train.parallel) of the run's dims (agoq.parallel_dims): replicas,
                    shards or a pipeline stage of the model as transformed above, with the gradient storage

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
from agoq.train.parallel import ParallelStrategy, World, apply_parallel
from agoq.train.plan_settings import RunSpec


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
        dims, shape = run.layout.dims, run.shape
        strategy = apply_parallel(
            model, mode=dims.mode, world=place.world, device=place.device, gradients=run.gradients,
            dtype=place.dtype, micro_batch=shape.micro_batch, seq_len=shape.seq_len, grad_accum=shape.grad_accum,
            layer_stage=place.layer_stage, node_size=dims.ranks_per_node, optimizer=run.cfg.optim.optimizer,
            master=run.cfg.optim.master,
            weight_gather=run.cfg.parallelism.weight_gather)
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


def remove_plan(model: nn.Module) -> None:
    """Undo steps 1-2 and 4 of `apply_plan`: no activation policy, no checkpointing, no offload."""
    remove_offload(model)
    checkpointing.remove_checkpointing(model)
    remove_activation_policy(model)


__all__ = ["apply_plan", "apply_policy", "apply_checkpointing", "apply_offload", "apply_compile", "apply_parallel",
           "remove_plan", "AppliedPlan", "Placement"]
