"""The parallel layout: how the processes of a run share the work, as one validated value with its rules.

Modes (`agoq train --parallel`):

  none      one process
  ddp       replicas: every rank keeps the whole model and optimizer state; gradients all-reduced (bf16 by
            torch's DDP, quangrad8 by QuanGrad's 8-bit all-reduce)
  fsdp      PyTorch's FSDP2: parameters, gradients and optimizer state 1/N per rank, gradients reduce-scattered
            by FSDP2 (bf16) or by SDP4Bit's TLq-HS (sdp4bit), weights gathered in bf16 or int8/int4 block codes
  hsdp      FSDP2 over replicate x shard (--node-size ranks per node): the state 1/node size per rank, gradients
            reduce-scattered within the node and all-reduced across nodes (bf16: FSDP2's own, exact; quangrad8:
            QuanGrad's 8-bit all-reduce across; sdp4bit: TLq-HS int8 within, TLq's 4-bit all-reduce across)
  pipeline  one stage of consecutive decoder layers per rank under the 1F1B schedule (one process per stage)

agoq's own sharded mode (`sharded`, SDP4Bit's sharded AdamW) was retired: it is refused with what to run instead
(agoq.vocabulary.SHARDED_RETIRED). none and ddp keep the same per-rank state (replicated: a checkpoint of one
resumes in the other); fsdp and hsdp shard it (and run sdp4bit gradients); fsdp and hsdp checkpoints (FSDP2's DTensors) resume in each other.
`ParallelLayout` holds a run's mode, world size, pipeline stages and node size (the ranks of a node for TLq-HS's
two-level reduce-scatter; hsdp's shard ranks) and refuses the combinations no run can have (fsdp in one process
among them: `one_rank` lifts that refusal for fsdp only, for `agoq profile`'s measurement of FSDP2's own cost on
one GPU, agoq.commands.profile_layouts; no flag sets it); `ParallelLayout.dims` is the same layout as dimensions
(agoq.parallel_dims: replicate x shard x pipeline ranks, validated against the world size), which plans carry and
the search writes.

A plan's layout (its `parallel` dims, agoq.parallel_dims, docs/formats.md "Plan") can fix the number of processes:
a pipeline of S stages runs S processes, one per stage; FSDP2 shards the state over the N
ranks of the profile, so each rank holds 1/N of it. Such a plan in another number of processes would train with
exit 0 and figures that do not apply, so it is refused with the command that launches it as searched
(`check_plan_world`).
Replicated plans keep the whole state on every rank and run in any number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from agoq.parallel_dims import ParallelDims, launch_line, launch_of
from agoq.vocabulary import (
    DDP,
    FSDP,
    FSDP2_MODES,
    GRADIENT_MODES,
    HSDP,
    MODE_GRADIENTS,
    NONE,
    PIPELINE,
    REPLICATED_MODES,
    SHARDED,
    SHARDED_MODES,
    SHARDED_RETIRED,
)
from agoq.vocabulary import PARALLEL_MODES as MODES

REPLICATED_STATE = "none or ddp (replicated)"  # what a checkpoint of one process or DDP records as its mode


def check_options(parallel: str | None, *, node_size: int | None = None, pipeline_stages: int | None = None) -> None:
    """The rules of `--parallel` and the options that go with it, before the number of processes is known
    (`parallel` None: not given): a known mode, --node-size only where SDP4Bit reduce-scatters, --pipeline-stages
    only for a pipeline. Raises ValueError with the command line's message."""
    if parallel == SHARDED:
        raise ValueError(SHARDED_RETIRED)
    if parallel is not None and parallel not in MODES:
        raise ValueError(f"--parallel must be one of {', '.join(MODES)}, got {parallel!r}")
    if node_size is not None and parallel not in SHARDED_MODES:
        raise ValueError("--node-size is for --parallel fsdp (SDP4Bit's two-level gradient "
                         "reduce-scatter) and hsdp (the ranks that shard, replicated across nodes)")
    if pipeline_stages is not None and parallel != PIPELINE:
        raise ValueError("--pipeline-stages is for --parallel pipeline")


def state_kind(mode: str) -> str:
    """"replicated" (none, ddp), "sharded" (fsdp) or the mode itself (hsdp keeps 1/node size, pipeline):
    modes of one kind keep the same per-rank state, so a plan searched for one runs in the other."""
    if mode == HSDP:
        return mode
    return "replicated" if mode in REPLICATED_MODES else "sharded" if mode in SHARDED_MODES else mode


@dataclass(frozen=True)
class ParallelLayout:
    """A run's parallel layout: its mode, processes (`world_size`), pipeline stages (the processes of a pipeline,
    else 1) and the ranks per node of SDP4Bit's reduce-scatter (None: torchrun's LOCAL_WORLD_SIZE). Built only
    valid: ValueError (the command line's message) otherwise.

    `one_rank`: one-rank FSDP2, the profile's measurement of FSDP2's own cost (its copies in and out of every
    unit's all-gather and reduce-scatter, its hooks, the int8/int4 gathers' kernels; TLq-HS of one rank returns the
    gradient unquantized) on one GPU: fsdp in a group of one process is allowed (the state 1/1 per rank, collectives
    over one rank). Only agoq.commands.profile_layouts sets it (agoq.train.config.JobConfig.one_rank_fsdp); `agoq
    train` refuses fsdp in one process."""

    mode: str = NONE
    world_size: int = 1
    pipeline_stages: int = 1
    node_size: int | None = None
    one_rank: bool = False

    def __post_init__(self) -> None:
        check_options(self.mode, node_size=self.node_size,
                      pipeline_stages=None if self.pipeline_stages == 1 else self.pipeline_stages)
        if self.world_size < 1:
            raise ValueError(f"a run has at least one process, got {self.world_size}")
        if self.mode == NONE and self.world_size > 1:
            raise ValueError(f"--parallel none with {self.world_size} processes: choose ddp, fsdp, hsdp or "
                             "pipeline")
        if self.mode != NONE and self.world_size < 2 and not (self.one_rank and self.mode == FSDP):
            raise ValueError(f"--parallel {self.mode} needs several processes: launch with "
                             f"torchrun --nproc-per-node N agoq train ... --parallel {self.mode}")
        if self.mode == HSDP and self.node_size is None:
            ParallelDims.hybrid_of(self.world_size, None)  # says what to give
        if self.pipelined and self.pipeline_stages != self.world_size:
            raise ValueError(f"--pipeline-stages {self.pipeline_stages} but {self.world_size} processes: run one "
                             "process per stage (pipeline and data parallelism are not combined)")
        self.dims  # the same layout as dimensions, checked by their rules against the world (ranks per node)

    @classmethod
    def of(cls, parallel: str | None, world_size: int, *, pipeline_stages: int | None = None,
           node_size: int | None = None, one_rank: bool = False) -> ParallelLayout:
        """The layout of a run of `world_size` processes given `--parallel` (None: none for one process, ddp under
        torchrun), `--pipeline-stages` (None: one per process) and `--node-size`; `one_rank` as the class says."""
        mode = parallel or (NONE if world_size == 1 else DDP)
        if pipeline_stages is None:
            pipeline_stages = world_size if mode == PIPELINE else 1
        return cls(mode, world_size, pipeline_stages, node_size, one_rank)

    @property
    def replicated(self) -> bool:
        """Every rank keeps the whole model and optimizer state (none, ddp)."""
        return self.mode in REPLICATED_MODES

    @property
    def sharded(self) -> bool:
        """The optimizer state (and FSDP2's parameters) is 1/N per rank (fsdp, hsdp)."""
        return self.mode in SHARDED_MODES

    @property
    def pipelined(self) -> bool:
        """One pipeline stage per rank."""
        return self.mode == PIPELINE

    @property
    def dims(self) -> ParallelDims:
        """The layout as dimensions (agoq.parallel_dims): replicate, shard (with its engine) or pipeline ranks."""
        return ParallelDims.of_mode(self.mode, self.world_size, self.pipeline_stages,
                                    self.node_size).validate(self.world_size)

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data: every rank, except in a pipeline, whose stages read one batch."""
        return self.dims.data_ranks

    @property
    def gradient_modes(self) -> tuple[str, ...]:
        """The gradient storage this mode runs (`check_gradients` refuses the others)."""
        return MODE_GRADIENTS[self.mode]

    @property
    def resume_state(self) -> str:
        """What a checkpoint records as its mode: one process and DDP keep the same replicated state, so their
        checkpoints are interchangeable, and so do fsdp and hsdp (FSDP2's DTensors by name, "fsdp"); every other
        mode resumes only in itself."""
        return REPLICATED_STATE if self.replicated else FSDP if self.mode in FSDP2_MODES else self.mode

    def check_gradients(self, gradients: str) -> None:
        """Refuse gradient storage this mode cannot run, saying which mode runs it."""
        if gradients not in GRADIENT_MODES:
            words = f"{', '.join(GRADIENT_MODES[:-1])} or {GRADIENT_MODES[-1]}"
            raise ValueError(f"gradient mode must be {words}, got {gradients!r}")
        if gradients in self.gradient_modes:
            return
        if gradients == "sdp4bit":
            raise ValueError("gradient mode sdp4bit is sharded data parallelism: use --parallel fsdp or hsdp "
                             "under torchrun (or pass --gradients quangrad8 / bf16 to run it otherwise)")
        raise ValueError("--parallel fsdp reduce-scatters gradients with FSDP2 (--gradients bf16) or SDP4Bit's "
                         "TLq-HS (--gradients sdp4bit), not with QuanGrad: use --parallel ddp, or hsdp (its 8-bit "
                         "all-reduce across nodes), for quangrad8")


# ------------------------------------------------------------------------------------ what a plan's launch needs


@dataclass(frozen=True)
class PlanLayout:
    """A layout that fixes the world size: its parallel mode and processes (None: several, number unrecorded)."""

    parallel: str
    processes: int | None

    def fits(self, parallel: str) -> bool:
        """Whether a run in parallel mode `parallel` runs this layout (sharded and fsdp count as one)."""
        return state_kind(parallel) == state_kind(self.parallel)


def plan_launch(plan) -> dict:
    """The plan's `launch` (processes, parallel mode, command), derived from its dims (`Plan.dims()`); {} when it
    has none (1.0 plans)."""
    dims = plan.dims()
    return {} if dims is None else launch_of(dims, plan.gradients.mode)


def plan_layout(plan) -> PlanLayout | None:
    """The layout `plan` needs a given number of processes for, or None when any number runs it (replicated).

    A pipeline of S > 1 stages needs S; a sharded state (FSDP2) needs its shard ranks (several, number unrecorded,
    where the plan was searched on one rank); a plan without dims (1.0) whose gradients are sdp4bit was agoq's
    retired own sharded step: ValueError saying what to run instead."""
    dims = plan.dims()
    if plan.pipeline.stages > 1:
        return PlanLayout(PIPELINE, plan.pipeline.stages)
    if dims is not None and dims.sharded:
        return PlanLayout(dims.mode, dims.world_size if dims.world_size > 1 else None)
    if dims is None and plan.gradients.mode == "sdp4bit":
        raise ValueError(f"the plan has sdp4bit gradients and no layout (schema 1.0): it ran the own sharded "
                         f"step. {SHARDED_RETIRED}")
    return None


def plan_parallel_default(plan, world) -> str | None:
    """The parallel mode the plan's layout asks for when --parallel is not given, or None (the usual default:
    none for one process, ddp under torchrun). Only several processes take it: one process is refused by
    `check_plan_world` with the command that launches the plan."""
    layout = plan_layout(plan)
    return layout.parallel if layout is not None and world.size > 1 else None


def launch_command(plan, layout: PlanLayout, model: str, plan_path: str) -> str:
    """The command that runs `plan` as searched: its `launch.command` with MODEL and PLAN.json filled in."""
    command = plan_launch(plan).get("command") if layout.processes else None
    dims = plan.dims()
    command = command or launch_line(layout.parallel, layout.processes or "N", plan.gradients.mode,
                                     plan.parallel.weight_gather if plan.parallel is not None else None,
                                     dims.shard if dims is not None and dims.hybrid else None)
    return command.replace("MODEL", str(model)).replace("PLAN.json", plan_path)


def check_plan_world(plan, world_size: int, parallel: str | None, model: str, plan_path: str) -> None:
    """Refuse to run `plan` in `world_size` processes, or in parallel mode `parallel` (None: not decided yet),
    when its layout needs another (`plan_layout`): the message gives the command that launches it."""
    layout = plan_layout(plan)
    if layout is None:
        return
    wrong_size = world_size != layout.processes if layout.processes else world_size < 2
    if not wrong_size and (parallel is None or layout.fits(parallel)):
        return
    what = (f"a {layout.processes}-stage pipeline" if layout.parallel == PIPELINE else
            f"{layout.parallel} over {layout.processes or 'several'} processes")
    now = f"{world_size} process{'es' if world_size > 1 else ''}" + ("" if wrong_size else f", --parallel {parallel}")
    raise ValueError(f"{plan_path}: the plan was searched for {what} (its predicted peak and step time hold for "
                     f"that layout only), this run has {now}: launch it as the plan says: "
                     f"{launch_command(plan, layout, model, plan_path)}; or search a plan for this layout")


__all__ = ["ParallelLayout", "MODES", "NONE", "DDP", "SHARDED", "FSDP", "HSDP", "PIPELINE", "REPLICATED_MODES",
           "SHARDED_MODES", "GRADIENT_MODES", "MODE_GRADIENTS", "check_options", "state_kind", "launch_line",
           "PlanLayout", "ParallelDims", "plan_launch", "plan_layout", "plan_parallel_default", "launch_command",
           "check_plan_world"]
