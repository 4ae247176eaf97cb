"""`agoq train`'s settings: small keyword-only parts that check themselves, composed into a `JobConfig`.

Each part's fields are named exactly like the command-line flags (`--seq-len` is `DataConfig.seq_len`),
so `TrainConfig(**flags)` can take the settings flat, as `agoq train` and the tests give them, and hand
each keyword to the part that owns it. One field is no flag and no flat setting: `ParallelConfig.one_rank_fsdp`
(one-rank FSDP2, `agoq profile`'s measurement of FSDP2's own cost), set only by `JobConfig.one_rank_fsdp()`.
Every check that needs nothing but the settings runs when a part is built (`__post_init__`), with the message
the command line prints; what needs the process group or the data (the parallel mode under torchrun, the
plan's batch shape) is checked by `prepare`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from agoq.layout import ParallelLayout, check_options
from agoq.vocabulary import ADAMW8BIT, FSDP2_MODES, MASTERS, OPTIMIZERS, PARALLEL_MODES, WEIGHT_GATHERS
DTYPES = ("bf16", "fp32", "fp16")


def _master_none_needs_adamw8bit() -> ValueError:
    return ValueError("--master none (bf16 parameters updated with stochastic rounding) needs --optimizer adamw8bit")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model, where and in what dtype it runs, and whether its decoder layers are compiled.

    `model` is a preset or a config.json (the command line's), or from Python any spec `agoq.models.build` takes
    (a dict of config fields, a LlamaConfig)."""

    model: Any = "llama-tiny"
    device: str | None = None
    dtype: str | None = None
    compile: bool | None = None  # torch.compile each decoder layer on its own (None: the plan's, else eager)
    # torch.compile's mode: default, reduce-overhead (CUDA graphs), max-autotune-no-cudagraphs (None: "default")
    compile_mode: str | None = None
    # torch.compile's partitioner budget: the share of activations it keeps, recomputing the rest (None: the plan's,
    # else 1)
    activation_memory_budget: float | None = None

    def __post_init__(self) -> None:
        if self.device and not self.device.startswith("cuda") and self.device != "cpu":
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.dtype and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.compile and self.compile_mode is None:
            object.__setattr__(self, "compile_mode", "default")
        budget = self.activation_memory_budget
        if budget is not None and not 0 < budget <= 1:
            raise ValueError(f"--activation-memory-budget must be in (0, 1], got {budget}")
        if budget is not None and self.compile is False:
            raise ValueError("--activation-memory-budget is torch.compile's partitioner budget: it needs --compile")


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """How activations and gradients are stored: a plan, or an activation policy, and the gradient mode.

    `plan` is a plan.json (the command line's) or, from Python, a loaded `agoq.formats.plan.Plan`."""

    plan: Any = None
    policy: str | None = None
    gradients: str | None = None
    checkpoint_all: bool = False
    # decoder layers whose saved activations go to host memory (agoq.runtime.activations.offload): the flag's text (all,
    # all-but-last, none, indices and ranges like 0-5,8), read into layer indices once (plan_settings.reconcile)
    offload: str | None = None
    host_budget: int | None = None  # bytes of pinned host memory offload may use (None: no cap; the flag is GB)

    def __post_init__(self) -> None:
        if self.plan and self.policy:
            raise ValueError("give either --plan or --policy, not both (a plan carries its own activation policy)")
        budget = self.host_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"--host-budget must be a positive number of bytes (an int; the command line reads GB "
                             f"or a size such as 30GiB: agoq.units.parse_size), got {budget!r}")
        if self.host_budget is not None and not self.offload and not self.plan:  # a plan may offload: see reconcile
            raise ValueError("--host-budget bounds --offload's host memory: give --offload too")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The corpus and the batch shape (None: the plan's, else the defaults; see `prepare`)."""

    data: str | None = None
    tokenizer: str | None = None
    seq_len: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer, its master weights, and the learning rate schedule's and clipping's numbers.

    `optimizer` and `master` None: the plan's, else adamw with fp32 masters (`prepare` decides)."""

    optimizer: str | None = None
    master: str | None = None
    lr: float = 1e-3
    warmup: int | None = None
    weight_decay: float = 0.1
    clip: float = 1.0

    def __post_init__(self) -> None:
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.master is not None and self.master not in MASTERS:
            raise ValueError(f"--master must be one of {', '.join(MASTERS)}, got {self.master!r}")
        if self.master == "none" and self.optimizer not in (None, ADAMW8BIT):
            raise _master_none_needs_adamw8bit()
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How several processes share the work (None: none for one process, ddp under torchrun)."""

    parallel: str | None = None
    pipeline_stages: int | None = None
    node_size: int | None = None
    weight_gather: str = "bf16"  # FSDP2's weight all-gather: bf16 (its own), int8 or int4 (block codes)
    # one-rank FSDP2: the profile's measurement of FSDP2's own cost (agoq.layout.ParallelLayout.one_rank); no flag,
    # not a flat setting: only JobConfig.one_rank_fsdp sets it
    one_rank_fsdp: bool = field(default=False, metadata={"flag": False})

    def __post_init__(self) -> None:
        check_options(self.parallel, node_size=self.node_size, pipeline_stages=self.pipeline_stages)
        if self.weight_gather not in WEIGHT_GATHERS:
            raise ValueError(f"--weight-gather must be one of {', '.join(WEIGHT_GATHERS)}, got {self.weight_gather!r}")
        if self.weight_gather != "bf16" and self.parallel not in (None, *FSDP2_MODES):
            raise ValueError(f"--weight-gather {self.weight_gather} quantizes FSDP2's weight all-gather: it runs "
                             f"with --parallel fsdp or hsdp, not {self.parallel}")

    def layout(self, world_size: int) -> ParallelLayout:
        """The parallel layout of a run with `world_size` processes; refuses one that does not fit it."""
        return ParallelLayout.of(self.parallel, world_size, pipeline_stages=self.pipeline_stages,
                                 node_size=self.node_size, one_rank=self.one_rank_fsdp)

    def mode_for(self, world_size: int) -> str:
        """The parallel mode of a run with `world_size` processes (`layout`'s)."""
        return self.layout(world_size).mode


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The run folder, how often a checkpoint replaces the last (0: never), whether to resume, and which
    settings a resumed run may change (`override`)."""

    out: str = "runs/train"
    checkpoint_every: int = 100
    resume: bool = False
    # settings --resume may change (run.json names, e.g. ("lr", "steps")); a comma-separated string is split
    override: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = self.override.split(",") if isinstance(self.override, str) else list(self.override or ())
        names = tuple(dict.fromkeys(n.strip().lstrip("-").replace("-", "_") for n in names if n.strip()))
        object.__setattr__(self, "override", names)
        if names and not self.resume:
            raise ValueError("--override names settings a resumed run may change: it needs --resume")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """The step loop: how long it runs, how often it evaluates, its seed and its progress bar."""

    steps: int = 200
    eval_every: int | None = None
    eval_batches: int = 8
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"--eval-every must be >= 1 (steps between evaluations; leave it unset for a tenth of "
                             f"--steps), got {self.eval_every}")
        if self.eval_batches < 1:
            raise ValueError(f"--eval-batches must be >= 1, got {self.eval_batches}")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything `agoq train` takes (see `agoq train --help` for each field's meaning and unit), in parts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)

    def __post_init__(self) -> None:
        # without a plan an unset optimizer is adamw; with one it is the plan's, which `prepare` checks
        if self.optim.master == "none" and self.optim.optimizer is None and not self.memory.plan:
            raise _master_none_needs_adamw8bit()

    @classmethod
    def flag_names(cls) -> list[str]:
        """Every setting's name, one per command-line flag (what `TrainConfig` takes as keywords)."""
        return [f.name for part in fields(cls) for f in fields(part.default_factory) if f.metadata.get("flag", True)]

    @classmethod
    def from_flags(cls, **flags) -> JobConfig:
        """Build the parts from flat settings named like the flags; an unknown name is a TypeError."""
        unknown = sorted(set(flags) - set(cls.flag_names()))
        if unknown:
            raise TypeError(f"unknown training setting(s): {', '.join(unknown)}")
        parts = {}
        for part in fields(cls):
            kind = part.default_factory
            parts[part.name] = kind(**{f.name: flags[f.name] for f in fields(kind) if f.name in flags})
        return cls(**parts)

    def one_rank_fsdp(self) -> JobConfig:
        """This run as one-rank FSDP2 (agoq.layout.ParallelLayout.one_rank): --parallel fsdp allowed in a group of
        one process, for `agoq profile`'s measurement of FSDP2's own cost on one GPU (agoq.commands.profile_layouts);
        other modes are unchanged."""
        return dataclasses.replace(self, parallelism=dataclasses.replace(self.parallelism, one_rank_fsdp=True))


def TrainConfig(**flags) -> JobConfig:
    """`agoq train`'s settings given flat, one keyword per command-line flag (`seq_len=32` is --seq-len 32):
    the `JobConfig` whose parts hold them. Each part checks itself here (ValueError, the CLI's message)."""
    return JobConfig.from_flags(**flags)


__all__ = ["JobConfig", "TrainConfig", "ModelConfig", "MemoryConfig", "DataConfig", "OptimizerConfig",
           "ParallelConfig", "CheckpointConfig", "LoopConfig", "PARALLEL_MODES", "OPTIMIZERS", "MASTERS"]
