"""The training loop behind `agoq train`: one process, or DDP / sharded / pipeline under torchrun.

`train(TrainConfig(...))` builds the model, applies the plan (or an activation policy), sets up the
parallel mode, the gradient storage (bf16, or 8-bit QuanGrad), the optimizer (AdamW, 8-bit AdamW, or
SDP4Bit's sharded AdamW), then runs `steps` optimizer steps, writing RUN_DIR/run.json,
RUN_DIR/metrics.jsonl and atomic checkpoints (docs/formats.md, "Run"). Everything that can be wrong
with the inputs is checked before the first step.

Numerics: parameters live in `dtype` (bf16 on GPUs by default); when that is not float32 the
optimizer steps float32 master copies and writes them back rounded. The loss is the mean token
cross-entropy over the step's micro-batches (and data-parallel ranks), computed by the chunked LM
head. The learning rate warms up linearly for `warmup` steps, then follows a cosine to `lr/10`.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agoq.activations.compile import mark_cudagraph_step
from agoq.environment import hardware, software_versions
from agoq.formats.plan import load_plan, plan_for_policy
from agoq.formats.run import RunRecord
from agoq.models.lm_loss import chunked_lm_loss
from agoq.optim.master_weights import MasterWeights
from agoq.train.checkpoint import (
    clean_partial,
    find_checkpoint,
    load_rank_payload,
    save_checkpoint,
)
from agoq.train.data import Batches, load_corpus

PARALLEL_MODES = ("none", "ddp", "sharded", "pipeline")
OPTIMIZERS = ("adamw", "adamw8bit")
MASTERS = ("fp32", "none")
DEFAULTS = {"seq_len": 256, "micro_batch": 8, "grad_accum": 1}
BETAS = (0.9, 0.95)
EPS = 1e-8


@dataclass
class TrainConfig:
    """Everything `agoq train` takes (see `agoq train --help` for each field's meaning and unit)."""

    model: str = "llama-tiny"
    plan: str | None = None
    policy: str | None = None
    gradients: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    steps: int = 200
    lr: float = 1e-3
    warmup: int | None = None
    weight_decay: float = 0.1
    clip: float = 1.0
    optimizer: str = "adamw"
    master: str = "fp32"
    parallel: str | None = None
    pipeline_stages: int | None = None
    checkpoint_every: int = 100
    eval_every: int | None = None
    eval_batches: int = 8
    resume: bool = False
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    out: str = "runs/train"
    checkpoint_all: bool = False
    node_size: int | None = None
    quiet: bool = False
    compile: bool = False  # torch.compile each decoder layer on its own (agoq.activations.compile)
    compile_mode: str = "default"  # torch.compile's mode: default, reduce-overhead (CUDA graphs), max-autotune-no-cudagraphs


class TrainingFailed(RuntimeError):
    """The run stopped on its own: a non-finite loss or gradient."""


def lr_at(step: int, cfg: TrainConfig, warmup: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine from lr to lr/10."""
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    span = max(1, cfg.steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


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


def _world(device_hint: str | None) -> World:
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


def _device(cfg: TrainConfig, world: World) -> torch.device:
    name = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
        return torch.device("cuda", world.local_rank if ":" not in name else int(name.split(":")[1]))
    if name != "cpu":
        raise ValueError(f"--device must be cpu or cuda, got {name!r}")
    return torch.device("cpu")


# --------------------------------------------------------------------------------------- setup


@dataclass
class Setup:
    """What `prepare` decided and built, before the first step."""

    cfg: TrainConfig
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
    warmup: int
    eval_every: int


def _dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    name = cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
    table = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype must be one of {', '.join(table)}, got {name!r}")
    return table[name]


def _policy(name: str, num_layers: int, stages: int, micro_batches: int, layer_stage: list[int] | None):
    import json

    from agoq.activations.policy import as_policy, stage_aware_policy
    from agoq.train.pipeline import in_flight_1f1b

    if name == "stage-aware":
        return stage_aware_policy(in_flight_1f1b(stages, micro_batches), num_layers, layer_stage)
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"policy file not found: {path}")
        return as_policy(json.loads(path.read_text()))
    return as_policy(name)


def prepare(cfg: TrainConfig, world: World) -> Setup:
    """Check every input and build the model: raises ValueError / FileNotFoundError before any training."""
    from agoq.activations.checkpointing import apply_checkpointing
    from agoq.activations.compile import compile_decoder_layers
    from agoq.activations.laaq import apply_activation_policy
    from agoq.activations.policy import split_layers
    from agoq.models import build, fingerprint, resolve_config

    device = _device(cfg, world)
    dtype = _dtype(cfg, device)
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
    if cfg.master not in MASTERS:
        raise ValueError(f"--master must be one of {', '.join(MASTERS)}, got {cfg.master!r}")
    if cfg.master == "none" and cfg.optimizer != "adamw8bit":
        raise ValueError("--master none (bf16 parameters updated with stochastic rounding) needs --optimizer adamw8bit")
    parallel = cfg.parallel or ("none" if world.size == 1 else "ddp")
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}")
    if parallel == "none" and world.size > 1:
        raise ValueError(f"--parallel none with {world.size} processes: choose ddp, sharded or pipeline")
    if parallel != "none" and world.size < 2:
        raise ValueError(f"--parallel {parallel} needs several processes: launch with "
                         f"torchrun --nproc-per-node N agoq train ... --parallel {parallel}")
    if cfg.node_size is not None and parallel != "sharded":
        raise ValueError("--node-size is for --parallel sharded (SDP4Bit's two-level gradient reduce-scatter)")
    if cfg.pipeline_stages is not None and parallel != "pipeline":
        raise ValueError("--pipeline-stages is for --parallel pipeline")
    if parallel == "pipeline" and cfg.pipeline_stages not in (None, world.size):
        raise ValueError(f"--pipeline-stages {cfg.pipeline_stages} but {world.size} processes: run one process per "
                         "stage (pipeline and data parallelism are not combined)")
    if cfg.plan and cfg.policy:
        raise ValueError("give either --plan or --policy, not both (a plan carries its own activation policy)")
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {cfg.steps}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")

    # the data first: its vocabulary decides the model's
    corpus = load_corpus(cfg.data, cfg.tokenizer)
    config = resolve_config(cfg.model)
    spec = {"spec": cfg.model, "vocab_size_of_spec": config.vocab_size}
    if config.vocab_size < corpus.vocab_size:
        import dataclasses

        config = dataclasses.replace(config, vocab_size=corpus.vocab_size)
        spec["vocab_overridden"] = True
    model = build(config, dtype=dtype, device=device, seed=cfg.seed)

    plan = None
    plan_record = None
    gradients = "bf16"
    training = dict(DEFAULTS)
    layer_stage = None
    policy_name = None
    if cfg.plan:
        plan = load_plan(cfg.plan, model)
        gradients = plan.gradients.mode
        training = {"seq_len": plan.training.seq_len, "micro_batch": plan.training.micro_batch,
                    "grad_accum": plan.training.grad_accum}
        if plan.num_layers != config.num_hidden_layers:
            raise ValueError(f"{cfg.plan}: the plan covers {plan.num_layers} layers, the model has "
                             f"{config.num_hidden_layers}")
        if parallel == "pipeline":
            if plan.pipeline.stages != world.size:
                raise ValueError(f"{cfg.plan}: the plan was made for {plan.pipeline.stages} pipeline stage(s), this "
                                 f"run has {world.size}: search a plan for {world.size} stages")
            schedule = getattr(plan.pipeline, "schedule", "1f1b")
            if schedule != "1f1b":
                raise ValueError(f"{cfg.plan}: the plan was made for the {schedule} schedule; agoq train runs 1F1B "
                                 "(its in-flight counts, hence its memory, differ): search a plan for 1f1b")
            layer_stage = [lp.stage for lp in plan.layers]
            training["grad_accum"] = max(training["grad_accum"], plan.pipeline.micro_batches)
    if cfg.gradients:
        gradients = cfg.gradients
    if gradients not in ("bf16", "quangrad8", "sdp4bit"):
        raise ValueError(f"gradient mode must be bf16, quangrad8 or sdp4bit, got {gradients!r}")
    if gradients == "sdp4bit" and parallel != "sharded":
        raise ValueError("gradient mode sdp4bit is sharded data parallelism: use --parallel sharded "
                         "(or --gradients quangrad8 / bf16)")
    if parallel == "sharded" and gradients == "quangrad8":
        raise ValueError("--parallel sharded reduces gradients with SDP4Bit (or exactly with --gradients bf16), "
                         "not with QuanGrad: use --parallel ddp for quangrad8")
    if parallel == "sharded" and cfg.optimizer == "adamw8bit":
        raise ValueError("--parallel sharded uses SDP4Bit's sharded AdamW (float32 moments, 1/N per rank): "
                         "--optimizer adamw8bit is for ddp, pipeline or one process")
    if plan is not None and world.rank == 0:
        given = {"seq_len": cfg.seq_len, "micro_batch": cfg.micro_batch}
        changed = {k: (training[k], v) for k, v in given.items() if v is not None and v != training[k]}
        if changed:
            print("agoq train: warning: the plan's predictions hold for its batch shape; this run changes "
                  + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()), file=sys.stderr)
    seq_len = cfg.seq_len or training["seq_len"]
    micro_batch = cfg.micro_batch or training["micro_batch"]
    grad_accum = cfg.grad_accum or (max(training["grad_accum"], world.size) if parallel == "pipeline"
                                    else training["grad_accum"])
    cfg.seq_len, cfg.micro_batch, cfg.grad_accum = seq_len, micro_batch, grad_accum
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
        _check_budget(plan, layer_stage, world, device, cfg.plan)

    # activations: the plan's settings and checkpointing, or a policy, on the whole model before any cut
    if plan is not None:
        plan.apply(model)
        policy_name = f"plan:{Path(cfg.plan).name}"
    elif cfg.policy:
        stages = world.size if parallel == "pipeline" else 1
        policy = _policy(cfg.policy, config.num_hidden_layers, stages, grad_accum, layer_stage)
        apply_activation_policy(model, policy)
        policy_name = policy.name
        plan_record = plan_for_policy(policy, model, gradients, micro_batch, seq_len, grad_accum, layer_stage, stages)
    if cfg.checkpoint_all:
        apply_checkpointing(model)
        policy_name = (policy_name + "+" if policy_name else "") + "checkpoint-all"
    if cfg.compile:
        compile_decoder_layers(model, mode=cfg.compile_mode)

    data_ranks = 1 if parallel == "pipeline" else world.size
    batches = Batches(corpus, seq_len, micro_batch, 1 if parallel == "pipeline" else grad_accum, data_ranks, cfg.seed)
    if parallel == "pipeline":
        batches.micro_batch = micro_batch * grad_accum  # one stacked batch per step, split by the schedule
    warmup = cfg.warmup if cfg.warmup is not None else min(100, max(1, cfg.steps // 10))
    eval_every = cfg.eval_every if cfg.eval_every is not None else max(1, cfg.steps // 10)
    spec.update(name=config.name, fingerprint=fingerprint(model), config=config.to_dict(),
                parameters=sum(p.numel() for p in model.parameters()))
    corpus_info = {"data": corpus.source, "tokenizer": corpus.tokenizer, "data_sha256": corpus.sha256,
                   "train_tokens": corpus.train.numel(), "val_tokens": corpus.val.numel(),
                   "vocab_size": config.vocab_size}
    if plan is not None:
        plan_record = plan.to_dict()
    return Setup(cfg, world, device, dtype, parallel, gradients, model, spec, plan, policy_name, layer_stage,
                 plan_record, batches, corpus_info, warmup, eval_every)


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


# --------------------------------------------------------------------------------------- the loop


class _LossModule(nn.Module):
    """model + chunked loss as one module, so DDP sees one forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return chunked_lm_loss(self.model.model(input_ids), self.model.lm_head.weight, labels)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Trainer:
    """One run: the parallel setup, optimizer, checkpointing and the step loop."""

    def __init__(self, s: Setup):
        self.s = s
        cfg, world, device = s.cfg, s.world, s.device
        self.record = RunRecord(cfg.out) if world.rank == 0 else None
        self.pipeline = None
        self.ddp = None
        self.qgrads = None
        model = s.model
        if s.parallel == "pipeline":
            from agoq.train.pipeline import Pipeline

            self.pipeline = Pipeline(model, s.layer_stage, world.rank, world.size, cfg.grad_accum, device,
                                     cfg.micro_batch, cfg.seq_len, s.dtype)
            self.module: nn.Module = self.pipeline.module
        else:
            self.module = model
            if world.size > 1:
                for p in model.parameters():  # every replica starts from rank 0's weights
                    dist.broadcast(p.data, 0)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if s.parallel == "ddp" and s.gradients == "bf16":
            self.ddp = nn.parallel.DistributedDataParallel(_LossModule(model),
                                                           device_ids=[device.index] if device.type == "cuda" else None)
        if s.gradients == "quangrad8":
            from agoq.comm.quangrad import QuantizedGradients

            # under DDP each bucket is reduced as soon as the last micro-batch's backward has filled it
            self.qgrads = QuantizedGradients(self.params, overlap=s.parallel == "ddp" and world.size > 1)
        # optimizer
        if s.parallel == "sharded":
            from agoq.optim.sdp4bit import SDP4BitOptimizer

            quantized = s.gradients == "sdp4bit"
            self.masters = None
            self.optimizer = SDP4BitOptimizer(self.params, lr=cfg.lr, betas=BETAS, eps=EPS,
                                              weight_decay=cfg.weight_decay, quantize_gradients=quantized,
                                              quantize_weights=quantized, seed=cfg.seed, on_nonfinite="raise",
                                              node_size=cfg.node_size)
        elif cfg.optimizer == "adamw8bit":
            # one fused pass per bucket: gradients read where they live (QuanGrad's codes or .grad), the clip
            # factor multiplied in, float32 masters (--master fp32) kept in the optimizer's state
            from agoq.optim.adamw8bit import FusedAdamW8bit

            self.weights = None
            self.masters = None
            self.optimizer = FusedAdamW8bit(self.params, lr=cfg.lr, betas=BETAS, eps=EPS,
                                            weight_decay=cfg.weight_decay, masters=cfg.master == "fp32",
                                            seed=cfg.seed)
        else:
            self.weights = MasterWeights(self.params)
            self.masters = self.weights.masters
            # torch's fused kernel on the GPU (one launch for all parameters), its default elsewhere
            self.optimizer = torch.optim.AdamW(self.weights.targets, lr=cfg.lr, betas=BETAS, eps=EPS,
                                               weight_decay=cfg.weight_decay, fused=device.type == "cuda" or None)

    # ---------------------------------------------------------------- run description

    def _settings(self) -> dict:
        s, cfg = self.s, self.s.cfg
        return {"seq_len": cfg.seq_len, "micro_batch": cfg.micro_batch, "grad_accum": cfg.grad_accum,
                "steps": cfg.steps, "lr": cfg.lr, "warmup": s.warmup, "optimizer": cfg.optimizer,
                "master": cfg.master if s.dtype != torch.float32 else "none (float32 parameters)",
                "parallel": s.parallel, "data": s.corpus_info["data"], "seed": cfg.seed,
                "gradients": s.gradients, "policy": s.policy_name, "dtype": str(s.dtype).replace("torch.", ""),
                "weight_decay": cfg.weight_decay, "clip": cfg.clip, "betas": list(BETAS),
                "min_lr": cfg.lr * 0.1, "schedule": "linear warmup, cosine to lr/10",
                "checkpoint_every": cfg.checkpoint_every, "eval_every": s.eval_every,
                "eval_batches": cfg.eval_batches, "pipeline_stages": s.world.size if s.parallel == "pipeline" else 1,
                "layer_stage": s.layer_stage, "tokens_per_step": self.tokens_per_step,
                "checkpoint_all": cfg.checkpoint_all, "compile": cfg.compile,
                "compile_mode": cfg.compile_mode if cfg.compile else None, "node_size": cfg.node_size,
                **{k: v for k, v in s.corpus_info.items() if k != "data"}}

    @property
    def tokens_per_step(self) -> int:
        c = self.s.cfg
        ranks = 1 if self.s.parallel == "pipeline" else self.s.world.size
        return c.seq_len * c.micro_batch * c.grad_accum * ranks

    def _resume_key(self) -> dict:
        settings = self._settings()
        keep = ("seq_len", "micro_batch", "grad_accum", "optimizer", "master", "parallel", "gradients", "policy", "dtype",
                "seed", "data_sha256", "tokenizer")
        return {"fingerprint": self.s.spec["fingerprint"], **{k: settings[k] for k in keep}}

    # ---------------------------------------------------------------- checkpoints

    def _payload(self, step: int) -> dict:
        payload = {"step": step, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "masters": [m.detach() for m in self.masters] if self.masters is not None else None,
                   "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                           "cuda": torch.cuda.get_rng_state(self.s.device) if self.s.device.type == "cuda" else None}}
        return payload

    def save(self, step: int) -> None:
        save_checkpoint(self.s.cfg.out, step, self.s.world.rank, self.s.world.size, self._payload(step),
                        {"resume": self._resume_key(), "parallel": self.s.parallel}, self.s.world.barrier)

    def try_resume(self) -> int | None:
        """Load the newest complete checkpoint when --resume; returns its step (None: starting fresh)."""
        cfg, world = self.s.cfg, self.s.world
        out = Path(cfg.out)
        found = find_checkpoint(out)
        if not cfg.resume:
            if found is not None or (out / "metrics.jsonl").exists():
                raise ValueError(f"{out} already holds a run: add --resume to continue it, or give another --out")
            return None
        if found is None:
            if world.rank == 0:
                print(f"agoq train: no checkpoint in {out} yet: starting from step 0", file=sys.stderr)
            return None
        folder, state = found
        if state.get("world") != world.size:
            raise ValueError(f"the checkpoint in {folder} was written by {state.get('world')} processes, this run has "
                             f"{world.size}: resume with the same number of processes")
        mine = self._resume_key()
        theirs = state.get("resume", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            raise ValueError(f"cannot resume {folder}: settings differ from the checkpoint's "
                             + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()))
        payload = load_rank_payload(folder, world.rank, self.s.device)
        self.module.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        if self.masters is not None:
            for m, saved in zip(self.masters, payload["masters"]):
                m.data.copy_(saved)
        torch.set_rng_state(payload["rng"]["torch"].cpu())
        random.setstate(payload["rng"]["python"])
        if payload["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(payload["rng"]["cuda"].cpu(), self.s.device)
        world.barrier()
        return int(state["step"])

    # ---------------------------------------------------------------- one step

    def _zero(self) -> None:
        for p in self.params:
            p.grad = None
        if self.masters is not None:
            self.weights.zero_grad()
        if self.qgrads is not None:
            self.qgrads.zero_()

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Every micro-batch of `step`: returns this rank's mean loss (a float32 tensor; 0 where it has none)."""
        s, cfg, dev = self.s, self.s.cfg, self.s.device
        if self.pipeline is not None:
            ids, labels = s.batches.micro(step, 0)
            loss = self.pipeline.step(ids.to(dev), labels.to(dev))
            return loss if loss is not None else torch.zeros((), device=dev)
        total = torch.zeros((), device=dev)
        rank = s.world.rank
        for micro in range(cfg.grad_accum):
            if cfg.compile:
                mark_cudagraph_step(cfg.compile_mode)  # CUDA graphs: the last micro-batch's outputs are done with
            ids, labels = s.batches.micro(step, micro, rank)
            ids, labels = ids.to(dev), labels.to(dev)
            last = micro == cfg.grad_accum - 1
            if last and self.qgrads is not None and s.parallel == "ddp" and s.world.size > 1:
                self.qgrads.prepare_sync()  # buckets all-reduce during this backward
            if self.ddp is not None:
                if last:
                    loss = self.ddp(ids, labels)
                else:
                    with self.ddp.no_sync():
                        loss = self.ddp(ids, labels)
            else:
                loss = chunked_lm_loss(self.module.model(ids), self.module.lm_head.weight, labels)
            (loss / cfg.grad_accum).backward()
            total += loss.detach().float() / cfg.grad_accum
        return total

    @property
    def _fused(self) -> bool:
        """The fused 8-bit AdamW step: it reads the gradients as stored."""
        return self.s.cfg.optimizer == "adamw8bit" and self.s.parallel != "sharded"

    def _gradients(self):
        """After backward: the gradients the optimizer will use (all-reduced where that is needed): float
        tensors, or for the fused step with QuanGrad the QuantizedGradients themselves (no float copy)."""
        s = self.s
        if self.qgrads is not None:
            if s.parallel == "ddp":
                self.qgrads.all_reduce(average=True)
            if self._fused:
                return self.qgrads
            grads = [self.qgrads.gradient(p) for p in self.params]
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return grads

    def _grad_norm(self, grads) -> float:
        if self._fused:
            from agoq.optim.fused_adamw import grad_norm_sq

            sq = grad_norm_sq(grads)  # one reduction over the stored gradients
        else:  # one foreach pass over the dense gradients, each tensor's norm in float32, summed in float64
            norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32) if grads else []
            sq = torch.stack(norms).double().square().sum() if norms else torch.zeros((), dtype=torch.float64,
                                                                                       device=self.s.device)
        if self.s.parallel == "pipeline":
            dist.all_reduce(sq)  # each stage holds its own parameters
        elif self.s.parallel == "sharded" and self.s.world.size > 1:
            dist.all_reduce(sq)  # local gradients: the root mean square of the ranks' norms
            sq /= self.s.world.size
        return float(sq.sqrt())

    def _apply(self, grads: list[torch.Tensor], scale: float) -> None:
        """Give the optimizer its gradients (scaled by `scale` for clipping) and take the step."""
        if self._fused:
            self.optimizer.step(grads=grads, clip_scale=scale)
            return
        if self.s.parallel == "sharded":
            for p, g in zip(self.params, grads):
                p.grad = g.mul_(scale) if scale != 1.0 else g
            self.optimizer.step()
            return
        self.weights.step(self.optimizer, grads, scale)

    def _mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.s.world.size == 1:
            return float(value)
        v = value.detach().float().reshape(1).clone()
        dist.all_reduce(v)
        if self.s.parallel == "pipeline":
            return float(v)  # only the last stage contributed
        return float(v) / self.s.world.size

    def _gather_ints(self, value: int) -> list[int]:
        if self.s.world.size == 1:
            return [value]
        dev = self.s.device if self.s.world.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([value], dtype=torch.int64, device=dev)
        out = [torch.zeros_like(mine) for _ in range(self.s.world.size)]
        dist.all_gather(out, mine)
        return [int(t) for t in out]

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches."""
        s = self.s
        self.module.eval()
        losses = []
        for ids, labels in s.batches.validation(s.cfg.eval_batches):
            ids, labels = ids.to(s.device), labels.to(s.device)
            if self.pipeline is not None:
                cfgm = s.model.config
                loss = self.pipeline.evaluate(ids, labels, cfgm.hidden_size, s.dtype)
                losses.append(loss if loss is not None else torch.zeros((), device=s.device))
            else:
                losses.append(chunked_lm_loss(self.module.model(ids), self.module.lm_head.weight, labels).float())
        self.module.train()
        mean = torch.stack(losses).mean()
        if s.parallel == "pipeline":
            return self._mean_over_ranks(mean)
        return float(mean)  # every data-parallel rank holds the same weights and batches

    # ---------------------------------------------------------------- the run

    def run(self) -> int:
        s, cfg, world = self.s, self.s.cfg, self.s.world
        if world.rank == 0:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            clean_partial(cfg.out)
        world.barrier()
        resumed = self.try_resume()
        start = resumed or 0
        if self.record is not None:
            plan = s.plan_record
            world_info = {"size": world.size, "local_size": world.local_size, "backend": world.backend}
            self.record.start({"model": s.spec, "plan": plan, "settings": self._settings(), "world": world_info,
                               "hardware": hardware(s.device, world.size), "software": software_versions()}, resumed)
        bar = None
        if world.rank == 0 and not cfg.quiet:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
        last_saved = start
        step = start
        try:
            for step in range(start, cfg.steps):
                lr = lr_at(step, cfg, s.warmup)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                if s.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(s.device)
                t0 = time.perf_counter()
                self._zero()
                loss_local = self._forward_backward(step)
                grads = self._gradients()
                loss = self._mean_over_ranks(loss_local)
                norm = self._grad_norm(grads)
                if not (math.isfinite(loss) and math.isfinite(norm)):
                    raise TrainingFailed(f"step {step + 1}: the loss is {loss} and the gradient norm {norm} (not "
                                         f"finite); the step was not taken. The last good checkpoint (step "
                                         f"{last_saved}) is kept: lower --lr or raise --warmup, then --resume")
                scale = min(1.0, cfg.clip / (norm + 1e-6)) if cfg.clip > 0 else 1.0
                self._apply(grads, scale)
                del grads  # else the next step's backward runs beside this step's gradients
                if s.device.type == "cuda":
                    torch.cuda.synchronize(s.device)
                seconds = time.perf_counter() - t0
                peaks = self._gather_ints(_peak_bytes(s.device))
                done = step + 1
                if self.record is not None:
                    self.record.append({"step": done, "loss": loss, "grad_norm": norm, "lr": lr,
                                        "tokens_per_s": self.tokens_per_step / seconds, "step_seconds": seconds,
                                        "peak_bytes": peaks, "time": time.time()})
                if done % s.eval_every == 0 or done == cfg.steps:
                    val = self.evaluate()
                    if self.record is not None:
                        self.record.append({"step": done, "val_loss": val, "time": time.time()})
                    if not math.isfinite(val):
                        raise TrainingFailed(f"step {done}: the validation loss is {val}. The last good checkpoint "
                                             f"(step {last_saved}) is kept")
                if cfg.checkpoint_every > 0 and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
                    self.save(done)
                    last_saved = done
                if self.record is not None:
                    if done % 10 == 0 or done == cfg.steps:
                        self.record.update(done)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        except TrainingFailed as e:
            if bar is not None:
                bar.close()
            if self.record is not None:
                self.record.update(step, "failed", str(e))
            if world.rank == 0:
                print(f"agoq train: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            if bar is not None:
                bar.close()
            if self.record is not None:
                self.record.update(step, "stopped", f"interrupted at step {step}; --resume continues from step "
                                                    f"{last_saved}")
            return 130
        if bar is not None:
            bar.close()
        if self.record is not None:
            self.record.update(cfg.steps, "finished")
            print(f"agoq train: finished {cfg.steps} steps; run in {cfg.out}", file=sys.stderr)
        return 0


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def train(cfg: TrainConfig) -> int:
    """Run one training (in this process; under torchrun, this rank's part); returns the exit code.

    SIGTERM (what torchrun and schedulers send) stops the run like Ctrl-C: status "stopped", exit 130.
    """
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    world = _world(cfg.device)
    try:
        setup = prepare(cfg, world)
        trainer = Trainer(setup)
        return trainer.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if world.initialised_here:
            dist.destroy_process_group()


__all__ = ["TrainConfig", "train", "prepare", "Trainer", "lr_at", "TrainingFailed", "PARALLEL_MODES", "OPTIMIZERS"]
