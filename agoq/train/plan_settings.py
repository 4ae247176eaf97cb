"""Where a plan and the flags meet: the settings a run takes, its parallel layout, and what run.json records.

A plan decides gradient storage, optimizer and masters, compile mode, micro-batch x accumulation, checkpointed
layers, offloaded layers and (through its `parallel` dims) the parallel mode and FSDP2's weight all-gather: unset settings take its values, and a
setting given otherwise is refused, naming the flag and the plan's value (`check_flags_against_plan`). The plan's
offloaded layers (a list of layer indices) are the run's unless `--offload` is given, and its `host_budget_bytes` the
run's host budget unless `--host-budget` is (it then bounds the plan's offload); sizes are bytes throughout (the
flag's GB are read into bytes by its argument parser). Without a plan the flags and their defaults decide.
`reconcile` does it all before anything is built and returns one typed `RunSpec` (what agoq.train.apply.apply_plan
receives); `record_of_plan` and `plan_for_policy` say what run.json records as the plan.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from agoq.runtime.activations.offload import parse_offload_layers
from agoq.formats.plan import new_plan
from agoq.layout import ParallelLayout, check_plan_world, plan_parallel_default, state_kind
from agoq.train.config import JobConfig
from agoq.train.data import BatchShape
from agoq.train.parallel import World
from agoq.vocabulary import ADAMW, COMPILED, DDP, EAGER, HSDP, NONE, PIPELINE, PLAN_TORCH_COMPILE_MODE

BATCH_DEFAULTS = {"seq_len": 256, "micro_batch": 8, "grad_accum": 1}
# run setting -> the flag that sets it, for what a plan decides (see `plan_settings`)
PLAN_FLAGS = {"gradients": "--gradients", "optimizer": "--optimizer", "master": "--master", "compile": "--compile",
              "compile_mode": "--compile-mode", "micro_batch": "--micro-batch", "grad_accum": "--grad-accum",
              "activation_memory_budget": "--activation-memory-budget",
              "checkpoint_all": "--checkpoint-all", "offload": "--offload", "parallel": "--parallel"}
COMPILED_BY_DEFAULT = (NONE, DDP)  # parallel modes compiled by default on CUDA (measured faster compiled)


def plan_settings(plan, parallel: str) -> dict[str, Any]:
    """What `plan` decides for a run in parallel mode `parallel`, named like the run settings: gradient storage,
    optimizer and masters, compile (on/off and torch.compile's mode), micro-batch and accumulation (a pipeline's
    accumulation is at least its micro-batches), whether every layer is checkpointed, the offloaded layers (a
    sorted list, [] for none: a plan before 1.4 offloads nothing) and its host budget in bytes
    (`host_budget_bytes`), and the parallel mode of its dims (`Plan.dims()`: its `parallel`, or an older plan's
    `launch`). What the plan does not record is None (decided by the flags and their defaults): a 1.0 plan has no
    `optimizer` section, `training.compile` or dims."""
    grad_accum = plan.training.grad_accum
    if parallel == PIPELINE:
        grad_accum = max(grad_accum, plan.pipeline.micro_batches)
    decided = {"gradients": plan.gradients.mode, "optimizer": None, "master": None, "compile": None,
               "compile_mode": None, "micro_batch": plan.training.micro_batch, "grad_accum": grad_accum,
               "checkpoint_all": len(plan.checkpoint_layers()) == plan.num_layers,
               "offload": plan.offload_layers(),
               # not a flag the plan refuses (`--host-budget` bounds its offload), a default
               "host_budget_bytes": plan.host_budget_bytes,
               "parallel": plan.dims().mode if plan.dims() is not None else None}
    states = plan.states_run_settings()
    if states["optimizer"]:
        decided.update(optimizer=plan.optimizer.name, master=plan.optimizer.master)
    if states["compile"]:
        compiled = plan.training.compile == COMPILED
        decided.update(compile=compiled, compile_mode=PLAN_TORCH_COMPILE_MODE if compiled else None,
                       activation_memory_budget=plan.training.activation_memory_budget)
    return decided


def given_settings(cfg: JobConfig) -> dict[str, Any]:
    """The settings a plan decides that this run's flags set explicitly (None / off: not given)."""
    given = {"gradients": cfg.memory.gradients, "optimizer": cfg.optim.optimizer, "master": cfg.optim.master,
             "compile": cfg.model.compile, "micro_batch": cfg.data.micro_batch, "grad_accum": cfg.data.grad_accum,
             "activation_memory_budget": cfg.model.activation_memory_budget,
             "checkpoint_all": True if cfg.memory.checkpoint_all else None, "offload": cfg.memory.offload,
             "parallel": cfg.parallelism.parallel}
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
    if name == "offload":
        return f"--offload {value.strip()}"
    return f"{PLAN_FLAGS[name]} {value}"


def _plan_text(name: str, value, plan) -> str:
    if name == "compile":
        return f"training.compile {COMPILED if value else EAGER}"
    if name == "compile_mode":
        return (f"compile mode {value!r} (training.compile compiled, priced in torch.compile's {value!r} mode)"
                if value else "no compile mode (training.compile eager)")
    if name == "checkpoint_all":
        layers = plan.checkpoint_layers()
        return (f"checkpointed layers {layers} of {plan.num_layers}" if layers
                else f"no checkpointed layer of {plan.num_layers}")
    if name == "offload":
        return (f"offloaded layers {_layer_ranges(value)} of {plan.num_layers} (layers[*].offload)" if value
                else f"no offloaded layer of {plan.num_layers} (it was priced with every layer's tensors on the "
                     "device)")
    if name == "parallel":
        dims = plan.dims()
        return f"parallel {value} ({dims.describe()}: {dims.world_size} process(es))"
    where = {"gradients": "gradients.mode", "optimizer": "optimizer.name", "master": "optimizer.master",
             "micro_batch": "training.micro_batch", "grad_accum": "training.grad_accum",
             "activation_memory_budget": "training.activation_memory_budget"}[name]
    return f"{where} {value}"


def _layer_ranges(layers: list[int]) -> str:
    """Sorted layer indices as `--offload` takes them: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def check_flags_against_plan(given: dict[str, Any], decided: dict[str, Any], plan, where: str) -> None:
    """Refuse flags that contradict what the plan decides (`plan_settings`), naming each flag and the plan's value.

    A flag equal to the plan's value is accepted; a plan without a `launch` decides no parallel mode, and modes of
    one state kind count as the same (`agoq.layout.state_kind`: one process and DDP replicate the state, fsdp
    shards it). `--offload` counts as the layers it names: it must name the
    plan's offloaded layers (`--offload none` those of a plan that offloads nothing)."""
    wrong = []
    for name, value in given.items():
        planned = decided.get(name)
        if name == "parallel" and (planned is None or state_kind(value) == state_kind(planned)):
            continue
        recorded_as = "compile" if name in ("compile_mode", "activation_memory_budget") else name
        if recorded_as in ("optimizer", "master", "compile") and decided.get(recorded_as) is None:
            continue  # the plan does not record it (1.0): the flag decides
        if name == "compile_mode" and given.get("compile", decided["compile"]) != decided["compile"]:
            continue  # the compile flag's own contradiction says it
        if name == "offload":
            if parse_offload_layers(value, plan.num_layers) != planned:
                wrong.append(f"{_flag_text(name, value)} contradicts the plan's {_plan_text(name, planned, plan)}")
            continue
        if value != planned:
            wrong.append(f"{_flag_text(name, value)} contradicts the plan's {_plan_text(name, planned, plan)}")
    if wrong:
        flags = "that flag" if len(wrong) == 1 else "those flags"
        raise ValueError(f"{where}: " + "; ".join(wrong) + f". The plan was searched (and priced) with its own "
                         f"values: drop {flags} to train it as it is, or re-run `agoq search` for what you want")


def compile_by_default(device: torch.device, parallel: str) -> bool:
    """Whether a run compiles its decoder layers when neither a flag nor a plan says: on CUDA in one process or
    DDP, where agoq's compiled layers were measured faster than eager (experiments/bench_compile.py,
    train_8b_alternatives.py); eager on the CPU and in the fsdp, hsdp and pipeline modes."""
    return device.type == "cuda" and parallel in COMPILED_BY_DEFAULT


def resolve_settings(cfg: JobConfig, decided: dict[str, Any], parallelism, *, compile_default: bool = False) -> JobConfig:
    """`cfg` with each unset optimizer, master and compile setting taken from `decided` (a plan's, {} without one),
    else the defaults (adamw, fp32 masters, `compile_default`; torch.compile's mode "default"), and `parallelism`.
    The offload is resolved on its own, into layer indices and bytes (`resolve_offload`)."""
    optimizer = cfg.optim.optimizer or decided.get("optimizer") or ADAMW
    master = cfg.optim.master or decided.get("master") or "fp32"
    compile_ = cfg.model.compile if cfg.model.compile is not None else \
        bool(decided["compile"]) if decided.get("compile") is not None else compile_default
    mode = cfg.model.compile_mode or decided.get("compile_mode") or PLAN_TORCH_COMPILE_MODE
    budget = cfg.model.activation_memory_budget or decided.get("activation_memory_budget")
    if budget is not None and not compile_:
        raise ValueError("--activation-memory-budget is torch.compile's partitioner budget: it needs --compile")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer=optimizer, master=master),
                               model=dataclasses.replace(cfg.model, compile=compile_, compile_mode=mode,
                                                         activation_memory_budget=budget),
                               parallelism=parallelism)


@dataclass(frozen=True)
class Offload:
    """What a run offloads: its decoder layers (sorted indices, () for none), the most pinned host memory they may
    hold in bytes (None: no cap), and whether the layers are the plan's (else the flags')."""

    layers: tuple[int, ...] = ()
    host_budget_bytes: int | None = None
    from_plan: bool = False


def _num_layers(cfg: JobConfig, plan) -> int:
    """The decoder layers `--offload`'s words and ranges count: the plan's (the model is checked to have as many),
    else the model's config."""
    if plan is not None:
        return plan.num_layers
    from agoq.models import resolve_config

    return resolve_config(cfg.model.model).num_hidden_layers


def resolve_offload(cfg: JobConfig, decided: dict[str, Any], plan=None) -> Offload:
    """The run's offload: `--offload` read into layer indices once (agoq.runtime.activations.offload.parse_offload_layers),
    else the plan's offloaded layers (`decided`, a list of indices, taken as it is); its host budget `--host-budget`
    (bytes), else the plan's `host_budget_bytes` where the plan's layers are offloaded. `--host-budget` for a plan
    that offloads nothing, with no `--offload`, is refused."""
    planned = list(decided.get("offload") or [])
    flag = cfg.memory.offload
    if cfg.memory.host_budget is not None and not planned and flag is None:
        raise ValueError("--host-budget bounds offload's host memory, and the plan offloads no layer: drop "
                         "--host-budget, or re-run `agoq search` for a plan that offloads")
    if flag is not None:
        layers = parse_offload_layers(flag, _num_layers(cfg, plan))
    else:
        layers = planned
    host_budget = cfg.memory.host_budget
    if host_budget is None and planned:  # a flag given with a plan that offloads names its layers (checked)
        host_budget = decided.get("host_budget_bytes")
    return Offload(tuple(layers), host_budget, from_plan=flag is None and bool(planned))


@dataclass(frozen=True)
class RunSpec:
    """A run's settings once the plan and the flags have met (see `reconcile`), typed and resolved: what `prepare`
    builds the run from and hands agoq.train.apply.apply_plan (no flag text, no GB: layer indices and bytes)."""

    cfg: JobConfig  # every setting as run: optimizer, masters, compile and the parallel mode filled in
    layout: ParallelLayout
    gradients: str  # gradient storage: the flag's, else the plan's, else bf16
    shape: BatchShape
    offload: Offload = Offload()

    @property
    def torch_compile_mode(self) -> str | None:
        """torch.compile's mode for the decoder layers (None: eager)."""
        return self.cfg.model.compile_mode if self.cfg.model.compile else None

    @property
    def activation_memory_budget(self) -> float | None:
        """torch.compile's partitioner budget (None: eager, or compiled keeping what it would)."""
        return self.cfg.model.activation_memory_budget if self.cfg.model.compile else None


Reconciled = RunSpec  # its earlier name


def reconcile(cfg: JobConfig, plan, where: str, world: World, device: torch.device) -> RunSpec:
    """The settings a run takes from `plan` (None: none) and its flags: a plan searched for another number of
    processes or another layout is refused (agoq.layout.check_plan_world), so is a flag that contradicts the plan,
    and gradient storage or an optimizer flag the parallel layout cannot run. Nothing is built."""
    parallel_cfg = cfg.parallelism
    if plan is not None:
        check_plan_world(plan, world.size, None, cfg.model.model, where)
        if parallel_cfg.parallel is None and plan_parallel_default(plan, world):
            parallel_cfg = dataclasses.replace(parallel_cfg, parallel=plan_parallel_default(plan, world))
    if plan is not None:
        parallel_cfg = plan_weight_gather(parallel_cfg, plan, where)
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if parallel_cfg.parallel == HSDP and parallel_cfg.node_size is None and local.isdigit():
        parallel_cfg = dataclasses.replace(parallel_cfg, node_size=int(local))  # hsdp's node: torchrun's
    layout = parallel_cfg.layout(world.size)
    decided = {}
    if plan is not None:
        decided = plan_settings(plan, layout.mode)
        check_flags_against_plan(given_settings(cfg), decided, plan, where)
        check_plan_world(plan, world.size, layout.mode, cfg.model.model, where)
    gradients = cfg.memory.gradients or decided.get("gradients") or "bf16"  # with a plan, equal to its mode
    layout.check_gradients(gradients)
    shape = batch_shape(cfg, plan, decided, layout, world)
    offload = resolve_offload(cfg, decided, plan)
    run_cfg = resolve_settings(cfg, decided, parallel_cfg, compile_default=compile_by_default(device, layout.mode))
    return RunSpec(run_cfg, layout, gradients, shape, offload)


def plan_weight_gather(parallel_cfg, plan, where: str):
    """`parallel_cfg` with FSDP2's weight all-gather the plan decides (its `parallel.weight_gather`, since 1.9; None:
    FSDP2's own bf16 gather): a plan searched with int8 gathers runs them without --weight-gather, and a
    --weight-gather other than the plan's (bf16 is the flag's default, so only int8 / int4 count as given) is
    refused, naming both: the plan was priced with its own."""
    planned = (plan.parallel.weight_gather if plan.parallel is not None else None) or "bf16"
    given = parallel_cfg.weight_gather
    if given not in ("bf16", planned):
        raise ValueError(f"{where}: --weight-gather {given} contradicts the plan's parallel.weight_gather {planned} "
                         "(it was searched and priced with that gather): drop --weight-gather to train it as it is, or "
                         "re-run `agoq search` for what you want")
    return dataclasses.replace(parallel_cfg, weight_gather=planned) if planned != given else parallel_cfg


def batch_shape(cfg: JobConfig, plan, decided: dict[str, Any], layout: ParallelLayout, world: World) -> BatchShape:
    """The flags' batch shape, else the plan's, else the defaults; a pipeline accumulates at least one micro-batch
    per stage. A sequence length other than the plan's is taken with a warning (its predictions hold for its
    own)."""
    data = cfg.data
    training = dict(BATCH_DEFAULTS)
    if plan is not None:
        training = {"seq_len": plan.training.seq_len, "micro_batch": plan.training.micro_batch,
                    "grad_accum": decided["grad_accum"]}
        if data.seq_len is not None and data.seq_len != training["seq_len"] and world.rank == 0:
            print(f"agoq train: warning: the plan's predictions hold for its sequence length; this run changes "
                  f"seq_len {training['seq_len']} -> {data.seq_len}", file=sys.stderr)
    grad_accum = data.grad_accum or (max(training["grad_accum"], layout.world_size) if layout.pipelined
                                     else training["grad_accum"])
    return BatchShape(data.seq_len or training["seq_len"], data.micro_batch or training["micro_batch"], grad_accum)


def record_of_plan(plan, cfg: JobConfig) -> dict:
    """What run.json records as the plan: the plan, with the optimizer, masters and compile mode the run used
    where the plan records none (a 1.0 plan)."""
    record = plan.to_dict()
    states = plan.states_run_settings()
    if not states["optimizer"]:
        record["optimizer"] = {"name": cfg.optim.optimizer, "master": cfg.optim.master}
    if not states["compile"]:
        record["training"]["compile"] = COMPILED if cfg.model.compile else EAGER
    return record


def plan_for_policy(policy, model, gradients: str, micro_batch: int, seq_len: int, grad_accum: int,
                    layer_stage: list[int] | None, stages: int, *, optimizer: str = "adamw", master: str = "fp32",
                    compile: bool = False, model_fingerprint: str | None = None) -> dict[str, Any]:
    """A plan (agoq.plan layout) recording what a run given `--policy` applies, for run.json: its activation
    settings, gradient mode, batch shape, the optimizer and masters it steps with and whether its layers are
    compiled (`compile`: torch.compile per decoder layer). `model_fingerprint` is the model's
    `agoq.models.fingerprint` where the caller has it (else it is computed here).

    `source.method` is "policy" and `source.objective` the policy's name; nothing is predicted. Validated as any
    plan is (agoq.formats.plan.new_plan); returned as its JSON data.
    """
    from agoq.runtime.activations.saved_bytes import find_decoder_layers
    from agoq.models import fingerprint

    num_layers = len(find_decoder_layers(model))
    stage_of = layer_stage or [0] * num_layers
    return new_plan(
        {"name": model.config.name, "fingerprint": model_fingerprint or fingerprint(model)},
        [{"layer": i, "stage": stage_of[i], "checkpoint": False, "kinds": dict(policy.settings(i))}
         for i in range(num_layers)],
        f"the policy {policy.name!r} as a plan",
        activations={"block": policy.block, "format": policy.format, "rounding": policy.rounding},
        gradients={"mode": gradients}, pipeline={"stages": stages, "micro_batches": grad_accum if stages > 1 else 1},
        training={"micro_batch": micro_batch, "seq_len": seq_len, "grad_accum": grad_accum,
                  "compile": COMPILED if compile else EAGER},
        optimizer={"name": optimizer, "master": master},
        source={"method": "policy", "objective": policy.name}).to_dict()


__all__ = ["reconcile", "RunSpec", "Reconciled", "Offload", "resolve_offload", "batch_shape", "plan_settings",
           "given_settings", "check_flags_against_plan", "resolve_settings", "compile_by_default", "record_of_plan",
           "plan_for_policy", "PLAN_FLAGS", "BATCH_DEFAULTS"]
