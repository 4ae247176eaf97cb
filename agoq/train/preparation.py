"""Everything decided and built before the first step: device, dtype, parallel mode, data, model, plan or policy.

`prepare(cfg, world)` checks what the settings alone cannot (the process group's size, the plan against
the model and the GPU, the batch shape against the model), loads the corpus, builds the model and applies
the plan's (or a policy's) activation settings, checkpointing and compilation, then returns a
`PreparedRun`. A plan decides gradient storage, optimizer and masters, compile mode, micro-batch x
accumulation, checkpointed layers and (through its `launch`) the parallel mode: unset settings take its
values, and a setting given otherwise is refused. Nothing is trained, and no run folder is touched, before it returns.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agoq.activations.compile import compile_decoder_layers, mark_cudagraph_step
from agoq.formats.plan import load_plan, plan_for_policy
from agoq.train.config import JobConfig, ModelConfig
from agoq.train.data import Batches, load_corpus
from agoq.train.parallel import World
from agoq.train.plan_layout import REPLICATED, SHARDED, check_plan_world, plan_launch, plan_parallel_default

BATCH_DEFAULTS = {"seq_len": 256, "micro_batch": 8, "grad_accum": 1}
GRADIENT_MODES = ("bf16", "quangrad8", "sdp4bit")


@dataclass(frozen=True)
class BatchShape:
    """The batch shape this run uses: the flags', else the plan's, else the defaults."""

    seq_len: int
    micro_batch: int
    grad_accum: int  # micro-batches per optimizer step (with a pipeline: the 1F1B schedule's)


@dataclass
class PreparedRun:
    """What `prepare` decided and built, before the first step."""

    cfg: JobConfig
    world: World
    device: torch.device
    dtype: torch.dtype
    parallel: str
    gradients: str
    model: nn.Module
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
    before_micro_batch: Callable[[], None]  # see compile_model


def _device(model_cfg: ModelConfig, world: World) -> torch.device:
    name = model_cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
        return torch.device("cuda", world.local_rank if ":" not in name else int(name.split(":")[1]))
    return torch.device("cpu")  # ModelConfig refused every other name


def _dtype(model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    name = model_cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]


def _nothing() -> None:
    pass


def compile_model(model: nn.Module, model_cfg: ModelConfig) -> Callable[[], None]:
    """--compile (and --compile-mode): torch.compile each decoder layer of `model` on its own. Returns what the
    loop calls before each training micro-batch (under CUDA graphs: the last micro-batch's outputs are done with)."""
    if not model_cfg.compile:
        return _nothing
    compile_decoder_layers(model, mode=model_cfg.compile_mode)
    mode = model_cfg.compile_mode
    return lambda: mark_cudagraph_step(mode)


def _policy(name: str, num_layers: int, stages: int, micro_batches: int, layer_stage: list[int] | None):
    from agoq.activations.policy import as_policy, stage_aware_policy
    from agoq.files import read_json_object
    from agoq.schedules import in_flight

    if name == "stage-aware":
        return stage_aware_policy(in_flight(stages, micro_batches), num_layers, layer_stage)
    if name.endswith(".json"):
        return as_policy(read_json_object(name, "policy file"))
    return as_policy(name)


# run setting -> the flag that sets it, for what a plan decides (see `plan_settings`)
PLAN_FLAGS = {"gradients": "--gradients", "optimizer": "--optimizer", "master": "--master", "compile": "--compile",
              "compile_mode": "--compile-mode", "micro_batch": "--micro-batch", "grad_accum": "--grad-accum",
              "checkpoint_all": "--checkpoint-all", "parallel": "--parallel"}
PLAN_COMPILE_MODE = "default"  # torch.compile's mode a compiled plan was priced in (agoq.profiler.compiled)


def plan_settings(plan, parallel: str) -> dict[str, Any]:
    """What `plan` decides for a run in parallel mode `parallel`, named like the run settings: gradient storage,
    optimizer and masters, compile (on/off and torch.compile's mode), micro-batch and accumulation (a pipeline's
    accumulation is at least its micro-batches), whether every layer is checkpointed, and the parallel mode of its
    `launch`. What the plan does not record is None (decided by the flags and their defaults): a 1.0 plan has no
    `optimizer` section, `training.compile` or `launch`."""
    grad_accum = plan.training.grad_accum
    if parallel == "pipeline":
        grad_accum = max(grad_accum, plan.pipeline.micro_batches)
    decided = {"gradients": plan.gradients.mode, "optimizer": None, "master": None, "compile": None,
               "compile_mode": None, "micro_batch": plan.training.micro_batch, "grad_accum": grad_accum,
               "checkpoint_all": len(plan.checkpoint_layers()) == plan.num_layers,
               "parallel": plan_launch(plan).get("parallel")}
    states = plan.states_run_settings()
    if states["optimizer"]:
        decided.update(optimizer=plan.optimizer.name, master=plan.optimizer.master)
    if states["compile"]:
        compiled = plan.training.compile == "compiled"
        decided.update(compile=compiled, compile_mode=PLAN_COMPILE_MODE if compiled else None)
    return decided


def record_of_plan(plan, cfg: JobConfig) -> dict:
    """What run.json records as the plan: the plan, with the optimizer, masters and compile mode the run used
    where the plan records none (a 1.0 plan)."""
    record = plan.to_dict()
    states = plan.states_run_settings()
    if not states["optimizer"]:
        record["optimizer"] = {"name": cfg.optim.optimizer, "master": cfg.optim.master}
    if not states["compile"]:
        record["training"]["compile"] = "compiled" if cfg.model.compile else "eager"
    return record


def given_settings(cfg: JobConfig) -> dict[str, Any]:
    """The settings a plan decides that this run's flags set explicitly (None / off: not given)."""
    given = {"gradients": cfg.memory.gradients, "optimizer": cfg.optim.optimizer, "master": cfg.optim.master,
             "compile": cfg.model.compile, "micro_batch": cfg.data.micro_batch, "grad_accum": cfg.data.grad_accum,
             "checkpoint_all": True if cfg.memory.checkpoint_all else None, "parallel": cfg.parallelism.parallel}
    # ModelConfig fills "default" in for --compile without --compile-mode: a mode is given only beside a
    # compile setting, or on its own when it is not the default
    if cfg.model.compile_mode is not None and (cfg.model.compile is not None or cfg.model.compile_mode != "default"):
        given["compile_mode"] = cfg.model.compile_mode
    return {k: v for k, v in given.items() if v is not None}


def _flag_text(name: str, value) -> str:
    if name == "compile":
        return "--compile" if value else "--no-compile"
    if name == "checkpoint_all":
        return "--checkpoint-all"
    return f"{PLAN_FLAGS[name]} {value}"


def _plan_text(name: str, value, plan) -> str:
    if name == "compile":
        return f"training.compile {'compiled' if value else 'eager'}"
    if name == "compile_mode":
        return (f"compile mode {value!r} (training.compile compiled, priced in torch.compile's {value!r} mode)"
                if value else "no compile mode (training.compile eager)")
    if name == "checkpoint_all":
        layers = plan.checkpoint_layers()
        return (f"checkpointed layers {layers} of {plan.num_layers}" if layers
                else f"no checkpointed layer of {plan.num_layers}")
    if name == "parallel":
        launch = plan_launch(plan)
        return f"launch parallel {value} ({launch.get('processes', '?')} process(es))"
    where = {"gradients": "gradients.mode", "optimizer": "optimizer.name", "master": "optimizer.master",
             "micro_batch": "training.micro_batch", "grad_accum": "training.grad_accum"}[name]
    return f"{where} {value}"


def check_flags_against_plan(given: dict[str, Any], decided: dict[str, Any], plan, where: str) -> None:
    """Refuse flags that contradict what the plan decides (`plan_settings`), naming each flag and the plan's value.

    A flag equal to the plan's value is accepted; a plan without a `launch` decides no parallel mode, one process
    and DDP count as the same (replicated state), and so do sharded and fsdp (both shard sdp4bit gradients)."""
    wrong = []
    for name, value in given.items():
        planned = decided.get(name)
        if name == "parallel" and (planned is None or any(value in kind and planned in kind
                                                          for kind in (REPLICATED, SHARDED))):
            continue
        recorded_as = "compile" if name == "compile_mode" else name
        if recorded_as in ("optimizer", "master", "compile") and decided.get(recorded_as) is None:
            continue  # the plan does not record it (1.0): the flag decides
        if name == "compile_mode" and given.get("compile", decided["compile"]) != decided["compile"]:
            continue  # the compile flag's own contradiction says it
        if value != planned:
            wrong.append(f"{_flag_text(name, value)} contradicts the plan's {_plan_text(name, planned, plan)}")
    if wrong:
        flags = "that flag" if len(wrong) == 1 else "those flags"
        raise ValueError(f"{where}: " + "; ".join(wrong) + f". The plan was searched (and priced) with its own "
                         f"values: drop {flags} to train it as it is, or re-run `agoq search` for what you want")


COMPILED_BY_DEFAULT = ("none", "ddp")  # parallel modes compiled by default on CUDA (measured faster compiled)


def compile_by_default(device: torch.device, parallel: str) -> bool:
    """Whether a run compiles its decoder layers when neither a flag nor a plan says: on CUDA in one process or
    DDP, where agoq's compiled layers were measured faster than eager (experiments/bench_compile.py,
    train_8b_alternatives.py); eager on the CPU and in the sharded, fsdp and pipeline modes."""
    return device.type == "cuda" and parallel in COMPILED_BY_DEFAULT


def resolve_settings(cfg: JobConfig, decided: dict[str, Any], parallelism, *, compile_default: bool = False) -> JobConfig:
    """`cfg` with each unset optimizer, master and compile setting taken from `decided` (a plan's, {} without one),
    else the defaults (adamw, fp32 masters, `compile_default`; torch.compile's mode "default"), and
    `parallelism`."""
    optimizer = cfg.optim.optimizer or decided.get("optimizer") or "adamw"
    master = cfg.optim.master or decided.get("master") or "fp32"
    compile_ = cfg.model.compile if cfg.model.compile is not None else \
        bool(decided["compile"]) if decided.get("compile") is not None else compile_default
    mode = cfg.model.compile_mode or decided.get("compile_mode") or "default"
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer=optimizer, master=master),
                               model=dataclasses.replace(cfg.model, compile=compile_, compile_mode=mode),
                               parallelism=parallelism)


def prepare(cfg: JobConfig, world: World) -> PreparedRun:
    """Check every input and build the model: raises ValueError / FileNotFoundError before any training.

    With a plan, every setting it decides (`plan_settings`) is the plan's unless a flag gives it; a flag that
    contradicts the plan is refused (`check_flags_against_plan`). The returned `cfg` holds the settings as run."""
    from agoq.activations.checkpointing import apply_checkpointing
    from agoq.activations.laaq import apply_activation_policy
    from agoq.activations.policy import split_layers
    from agoq.models import build, fingerprint, resolve_config

    memory, data = cfg.memory, cfg.data
    plan = load_plan(memory.plan) if memory.plan else None
    device = _device(cfg.model, world)
    dtype = _dtype(cfg.model, device)
    parallel_cfg = cfg.parallelism
    if plan is not None:
        check_plan_world(plan, world.size, None, cfg.model.model, memory.plan)
        if parallel_cfg.parallel is None and plan_parallel_default(plan, world):
            parallel_cfg = dataclasses.replace(parallel_cfg, parallel=plan_parallel_default(plan, world))
    parallel = parallel_cfg.mode_for(world.size)
    decided = plan_settings(plan, parallel) if plan is not None else {}
    if plan is not None:
        check_flags_against_plan(given_settings(cfg), decided, plan, memory.plan)
        check_plan_world(plan, world.size, parallel, cfg.model.model, memory.plan)
    flags = cfg
    cfg = resolve_settings(cfg, decided, parallel_cfg, compile_default=compile_by_default(device, parallel))

    # the data first: its vocabulary decides the model's
    corpus = load_corpus(data.data, data.tokenizer)
    config = resolve_config(cfg.model.model)
    spec = {"spec": cfg.model.model, "vocab_size_of_spec": config.vocab_size}
    if config.vocab_size < corpus.vocab_size:
        config = dataclasses.replace(config, vocab_size=corpus.vocab_size)
        spec["vocab_overridden"] = True
    model = build(config, dtype=dtype, device=device, seed=cfg.loop.seed)

    plan_record = None
    gradients = "bf16"
    training = dict(BATCH_DEFAULTS)
    layer_stage = None
    policy_name = None
    if plan is not None:
        try:
            plan.check_model(model)
        except ValueError as e:
            raise ValueError(f"{memory.plan}: {e}") from None
        gradients = plan.gradients.mode
        training = {"seq_len": plan.training.seq_len, "micro_batch": plan.training.micro_batch,
                    "grad_accum": decided["grad_accum"]}
        if plan.num_layers != config.num_hidden_layers:
            raise ValueError(f"{memory.plan}: the plan covers {plan.num_layers} layers, the model has "
                             f"{config.num_hidden_layers}")
        if parallel == "pipeline":  # with as many processes as the plan has stages (check_plan_world)
            schedule = getattr(plan.pipeline, "schedule", "1f1b")
            if schedule != "1f1b":
                raise ValueError(f"{memory.plan}: the plan was made for the {schedule} schedule; agoq train runs 1F1B "
                                 "(its in-flight counts, hence its memory, differ): search a plan for 1f1b")
            layer_stage = [lp.stage for lp in plan.layers]
    if memory.gradients:
        gradients = memory.gradients  # with a plan, equal to its mode (check_flags_against_plan)
    if gradients not in GRADIENT_MODES:
        raise ValueError(f"gradient mode must be bf16, quangrad8 or sdp4bit, got {gradients!r}")
    if gradients == "sdp4bit" and parallel not in SHARDED:  # a sharded plan was refused by check_plan_world
        raise ValueError("gradient mode sdp4bit is sharded data parallelism: use --parallel sharded or fsdp under "
                         "torchrun (or pass --gradients quangrad8 / bf16 to run it otherwise)")
    if parallel == "sharded" and gradients == "quangrad8":
        raise ValueError("--parallel sharded reduces gradients with SDP4Bit (or exactly with --gradients bf16), "
                         "not with QuanGrad: use --parallel ddp for quangrad8")
    if parallel == "fsdp" and gradients == "quangrad8":
        raise ValueError("--parallel fsdp reduce-scatters gradients with FSDP2 (--gradients bf16) or SDP4Bit's "
                         "TLq-HS (--gradients sdp4bit), not with QuanGrad: use --parallel ddp for quangrad8")
    if parallel == "fsdp":
        from agoq.comm.fsdp_collectives import _require_protocol

        _require_protocol()  # FSDP2's custom reduce-scatter (torch >= 2.9): a clear message before anything runs
    # a plan's adamw8bit with float32 masters under sharded is SDP4Bit's step itself; only the flag is refused
    if parallel == "sharded" and given_settings(flags).get("optimizer") == "adamw8bit":
        raise ValueError("--parallel sharded uses SDP4Bit's sharded AdamW (float32 master and 8-bit moments, 1/N per rank): "
                         "--optimizer adamw8bit is for ddp, pipeline or one process")
    if plan is not None and world.rank == 0:
        if data.seq_len is not None and data.seq_len != training["seq_len"]:
            print(f"agoq train: warning: the plan's predictions hold for its sequence length; this run changes "
                  f"seq_len {training['seq_len']} -> {data.seq_len}", file=sys.stderr)
    seq_len = data.seq_len or training["seq_len"]
    micro_batch = data.micro_batch or training["micro_batch"]
    grad_accum = data.grad_accum or (max(training["grad_accum"], world.size) if parallel == "pipeline"
                                     else training["grad_accum"])
    shape = BatchShape(seq_len, micro_batch, grad_accum)
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
                         f"({config.max_position_embeddings})")
    if parallel == "pipeline":
        if config.num_hidden_layers < world.size:
            raise ValueError(f"{config.num_hidden_layers} layers cannot be cut into {world.size} pipeline stages")
        layer_stage = layer_stage or split_layers(config.num_hidden_layers, world.size)
        if grad_accum < world.size:
            raise ValueError(f"the 1F1B schedule needs --grad-accum (micro-batches per step) >= the {world.size} "
                             f"pipeline stages, got {grad_accum}")

    if device.type == "cuda" and plan is not None:
        _check_budget(plan, layer_stage, world, device, memory.plan)

    # activations: the plan's settings and checkpointing, or a policy, on the whole model before any cut
    if plan is not None:
        plan.apply(model)
        policy_name = f"plan:{Path(memory.plan).name}"
    elif memory.policy:
        stages = world.size if parallel == "pipeline" else 1
        policy = _policy(memory.policy, config.num_hidden_layers, stages, grad_accum, layer_stage)
        apply_activation_policy(model, policy)
        policy_name = policy.name
        plan_record = plan_for_policy(policy, model, gradients, micro_batch, seq_len, grad_accum, layer_stage, stages,
                                      optimizer=cfg.optim.optimizer, master=cfg.optim.master,
                                      compile=cfg.model.compile)
    if memory.checkpoint_all and plan is None:  # a plan it agrees with checkpoints every layer already
        apply_checkpointing(model)
        policy_name = (policy_name + "+" if policy_name else "") + "checkpoint-all"
    before_micro_batch = compile_model(model, cfg.model)

    data_ranks = 1 if parallel == "pipeline" else world.size
    batches = Batches(corpus, seq_len, micro_batch, 1 if parallel == "pipeline" else grad_accum, data_ranks,
                      cfg.loop.seed)
    if parallel == "pipeline":
        batches.micro_batch = micro_batch * grad_accum  # one stacked batch per step, split by the schedule
    steps = cfg.loop.steps
    warmup = cfg.optim.warmup if cfg.optim.warmup is not None else min(100, max(1, steps // 10))
    eval_every = cfg.loop.eval_every if cfg.loop.eval_every is not None else max(1, steps // 10)
    spec.update(name=config.name, fingerprint=fingerprint(model), config=config.to_dict(),
                parameters=sum(p.numel() for p in model.parameters()))
    corpus_info = {"data": corpus.source, "tokenizer": corpus.tokenizer, "data_sha256": corpus.sha256,
                   "train_tokens": corpus.train.numel(), "val_tokens": corpus.val.numel(),
                   "vocab_size": config.vocab_size}
    if plan is not None:
        plan_record = record_of_plan(plan, cfg)
    return PreparedRun(cfg, world, device, dtype, parallel, gradients, model, spec, plan, policy_name, layer_stage,
                       plan_record, batches, corpus_info, shape, warmup, eval_every, before_micro_batch)


def _check_budget(plan, layer_stage, world: World, device: torch.device, where: str) -> None:
    """Refuse a plan whose predicted peak (else its budget) exceeds this GPU's memory."""
    total = torch.cuda.get_device_properties(device).total_memory
    peaks = plan.predicted.peak_bytes_per_stage
    stage = world.rank if layer_stage is not None and len(peaks) > 1 else None
    if peaks:
        need = peaks[stage] if stage is not None and stage < len(peaks) else max(peaks)
        what = "predicted peak"
    elif plan.budget_bytes:
        need, what = plan.budget_bytes, "memory budget"
    else:
        return
    if need > total:
        from agoq.units import format_bytes

        raise ValueError(f"{where}: the plan's {what} is {format_bytes(need)} but this GPU "
                         f"({torch.cuda.get_device_name(device)}) has {format_bytes(total)}: search a plan with "
                         f"--budget below {format_bytes(total)} for this device")


__all__ = ["prepare", "PreparedRun", "BatchShape", "compile_model", "plan_settings", "given_settings",
           "check_flags_against_plan", "resolve_settings", "compile_by_default", "record_of_plan", "PLAN_FLAGS"]
