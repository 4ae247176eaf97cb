"""Everything built before the first step: the data, the model, and the plan (or a policy) applied to it.

`prepare(cfg, world)` reads the plan, settles the run's settings where the plan and the flags meet
(`agoq.train.plan_settings.reconcile`: the parallel layout, gradient storage, optimizer, compile mode, batch
shape and offload, each checked, in one typed `RunSpec`: layer indices and bytes, no flag text), loads the corpus,
builds the model, checks it against the plan and the batch shape, then applies the activation settings,
checkpointing, compilation, offload and the parallel strategy in one ordered step (`agoq.train.apply.apply_plan`) and
returns a `PreparedRun`. Nothing is trained, and no run folder is touched, before it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agoq.formats.plan import Plan, load_plan
from agoq.layout import ParallelLayout
from agoq.runtime.activations.offload import ActivationOffload
from agoq.train.apply import Placement, apply_plan
from agoq.train.config import JobConfig
from agoq.train.data import Batches, BatchShape, Corpus, load_corpus
from agoq.train.device import check_budget, run_device, run_dtype
from agoq.train.parallel import ParallelStrategy, World
from agoq.train.plan_settings import RunSpec, plan_for_policy, reconcile, record_of_plan
from agoq.parallel_dims import FSDP2_ENGINE


@dataclass
class PreparedRun:
    """What `prepare` decided and built, before the first step."""

    cfg: JobConfig
    world: World
    device: torch.device
    dtype: torch.dtype
    layout: ParallelLayout
    gradients: str
    model: nn.Module  # the whole model, the plan applied (a pipeline stage of it is `strategy.module`)
    strategy: ParallelStrategy  # this rank's part of the work (agoq.train.parallel)
    spec: dict
    plan: Any
    policy_name: str | None
    layer_stage: list[int] | None
    plan_record: dict | None  # what run.json records as the plan (the plan, or the policy as one)
    batches: Batches
    corpus_info: dict
    shape: BatchShape
    warmup: int
    eval_every: int
    before_micro_batch: Callable[[], None]  # see agoq.train.apply.apply_compile
    offload_layers: list[int] = field(default_factory=list)  # decoder layers whose saved tensors go to the host
    offload: ActivationOffload | None = None  # their hooks, pool and byte counts (None: nothing offloaded)
    host_budget_bytes: int | None = None  # the most pinned host memory the offload may hold (None: no cap)


def read_plan(plan) -> tuple[Plan | None, str]:
    """The run's plan (--plan: a plan.json, or from Python a Plan) and what messages call it."""
    if plan is None or isinstance(plan, Plan):
        return plan, "plan"
    return load_plan(plan), str(plan)


def _policy(name: str, num_layers: int, stages: int, micro_batches: int, layer_stage: list[int] | None):
    """The --policy of a run: a preset, a policy .json, or stage-aware (per-stage bits from the 1F1B counts)."""
    from agoq.runtime.activations.policy import as_policy, stage_aware_policy
    from agoq.files import read_json_object
    from agoq.schedules import in_flight

    if name == "stage-aware":
        return stage_aware_policy(in_flight(stages, micro_batches), num_layers, layer_stage)
    if name.endswith(".json"):
        return as_policy(read_json_object(name, "policy file"))
    return as_policy(name)


def _build_model(cfg: JobConfig, corpus: Corpus, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, dict]:
    """The model, its vocabulary raised to the corpus's where smaller, and run.json's `model` section."""
    from agoq.models import build, fingerprint, resolve_config

    config = resolve_config(cfg.model.model)
    spec = {"spec": cfg.model.model, "vocab_size_of_spec": config.vocab_size}
    if config.vocab_size < corpus.vocab_size:
        config = dataclasses.replace(config, vocab_size=corpus.vocab_size)
        spec["vocab_overridden"] = True
    model = build(config, dtype=dtype, device=device, seed=cfg.loop.seed)
    spec.update(name=config.name, fingerprint=fingerprint(model), config=config.to_dict(),
                parameters=sum(p.numel() for p in model.parameters()))
    return model, spec


def _check_model(plan: Plan | None, where: str, model: nn.Module, spec: dict,
                 settled: RunSpec, seq_len_flag: bool = True) -> list[int] | None:
    """Refuse a plan made for another model or layer count, or a shape or pipeline this model cannot take
    (`seq_len_flag` False: the sequence length is the plan's, and is named as its field); returns the pipeline stage
    of each decoder layer (None: no pipeline)."""
    from agoq.runtime.activations.policy import split_layers

    layers = model.config.num_hidden_layers
    layer_stage = None
    if plan is not None:
        try:
            plan.check_model(spec["fingerprint"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if plan.num_layers != layers:
            raise ValueError(f"{where}: the plan covers {plan.num_layers} layers, the model has {layers}")
        if settled.layout.pipelined:  # with as many processes as the plan has stages (check_plan_world)
            schedule = getattr(plan.pipeline, "schedule", "1f1b")
            if schedule != "1f1b":
                raise ValueError(f"{where}: the plan was made for the {schedule} schedule; agoq train runs 1F1B "
                                 "(its in-flight counts, hence its memory, differ): search a plan for 1f1b")
            layer_stage = [lp.stage for lp in plan.layers]
    shape = settled.shape
    if shape.seq_len > model.config.max_position_embeddings:
        given = "--seq-len" if seq_len_flag or plan is None else f"{where}: training.seq_len"
        raise ValueError(f"{given} {shape.seq_len} exceeds the model's max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    stages = settled.layout.pipeline_stages
    if settled.layout.pipelined:
        if layers < stages:
            raise ValueError(f"{layers} layers cannot be cut into {stages} pipeline stages")
        layer_stage = layer_stage or split_layers(layers, stages)
        if shape.grad_accum < stages:
            raise ValueError(f"the 1F1B schedule needs --grad-accum (micro-batches per step) >= the {stages} "
                             f"pipeline stages, got {shape.grad_accum}")
    return layer_stage


def prepare(cfg: JobConfig, world: World) -> PreparedRun:
    """Check every input, build the model and apply the plan: raises ValueError / FileNotFoundError before any
    training. The returned `cfg` holds the settings as run (agoq.train.plan_settings.reconcile)."""
    memory = cfg.memory
    plan, where = read_plan(memory.plan)
    device = run_device(cfg.model, world)
    dtype = run_dtype(cfg.model, device)
    settled = reconcile(cfg, plan, where, world, device)
    seq_len_flag = cfg.data.seq_len is not None
    cfg, layout, shape = settled.cfg, settled.layout, settled.shape

    corpus = load_corpus(cfg.data.data, cfg.data.tokenizer)  # the data first: its vocabulary decides the model's
    model, spec = _build_model(cfg, corpus, dtype, device)
    layer_stage = _check_model(plan, where, model, spec, settled, seq_len_flag)
    if device.type == "cuda" and plan is not None:
        check_budget(plan, layer_stage, world, device, where)

    # activations: the plan's settings and checkpointing, or a policy, on the whole model before any cut
    policy, checkpoint, policy_name, plan_record = None, (), None, None
    if plan is not None:
        policy, checkpoint = plan.activation_policy(), plan.checkpoint_layers()
        policy_name = f"plan:{Path(where).name}"
        plan_record = record_of_plan(plan, cfg)
    elif memory.policy:
        stages = layout.pipeline_stages
        policy = _policy(memory.policy, model.config.num_hidden_layers, stages, shape.grad_accum, layer_stage)
        policy_name = policy.name
        plan_record = plan_for_policy(policy, model, settled.gradients, shape.micro_batch, shape.seq_len,
                                      shape.grad_accum, layer_stage, stages, optimizer=cfg.optim.optimizer,
                                      master=cfg.optim.master, compile=cfg.model.compile,
                                      model_fingerprint=spec["fingerprint"])
    if memory.checkpoint_all and plan is None:  # a plan it agrees with checkpoints every layer already
        checkpoint = range(model.config.num_hidden_layers)
        policy_name = (policy_name + "+" if policy_name else "") + "checkpoint-all"
    # the offload as run: --offload's layers, else the plan's, and the host budget in bytes (plan_settings.reconcile)
    offload = list(settled.offload.layers)
    dims = layout.dims
    if offload and (dims.engine == FSDP2_ENGINE or dims.pipeline > 1):
        if settled.offload.from_plan:
            raise ValueError(f"{where}: layers[*].offload: the plan offloads layer(s) {offload}, which runs in one "
                             f"process or with --parallel ddp, not {layout.mode}: train it in one of "
                             "those, or re-run `agoq search` for this layout")
        raise ValueError(f"--offload runs in one process, or with --parallel ddp, not {layout.mode}: "
                         "leave --offload out, or train without it")
    weight_gather = cfg.parallelism.weight_gather
    if weight_gather != "bf16" and dims.engine != FSDP2_ENGINE:
        raise ValueError(f"--weight-gather {weight_gather} quantizes FSDP2's weight all-gather: it runs with "
                         f"--parallel fsdp or hsdp, not {layout.mode}; leave --weight-gather out or train with fsdp")
    applied = apply_plan(model, policy=policy, checkpoint=checkpoint, run=settled,
                         place=Placement(world, device, dtype, layer_stage))

    # one stacked batch per step for a pipeline, split by the schedule
    batches = Batches(corpus, shape.seq_len, shape.micro_batch, 1 if dims.pipeline > 1 else shape.grad_accum,
                      dims.data_ranks, cfg.loop.seed)
    if dims.pipeline > 1:
        batches.micro_batch = shape.micro_batch * shape.grad_accum
    steps = cfg.loop.steps
    warmup = cfg.optim.warmup if cfg.optim.warmup is not None else min(100, max(1, steps // 10))
    eval_every = cfg.loop.eval_every if cfg.loop.eval_every is not None else max(1, steps // 10)
    corpus_info = {"data": corpus.source, "tokenizer": corpus.tokenizer, "data_sha256": corpus.sha256,
                   "train_tokens": corpus.train.numel(), "val_tokens": corpus.val.numel(),
                   "vocab_size": model.config.vocab_size}
    return PreparedRun(cfg, world, device, dtype, layout, settled.gradients, model, applied.strategy, spec, plan,
                       policy_name, layer_stage, plan_record, batches, corpus_info, shape, warmup, eval_every,
                       applied.before_micro_batch, offload, applied.offload, settled.offload.host_budget_bytes)


__all__ = ["prepare", "PreparedRun", "read_plan"]
