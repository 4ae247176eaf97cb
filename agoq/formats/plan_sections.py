"""The sections of a plan (agoq.formats.plan.Plan, docs/formats.md "Plan"): each a pydantic model that checks its own
fields and keeps the fields it does not know (formats grow additively).

The words a section accepts (gradient modes, optimizers and masters, compile modes) are agoq.vocabulary's;
`agoq.formats.plan` re-exports every section, so `from agoq.formats.plan import LayerPlan` keeps working.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from agoq.runtime.activations.policy import KEEP, KINDS, check_setting
from agoq.parallel_dims import PLAN_ENGINES, ParallelDims
from agoq.runtime.quant.layout import check_arguments
from agoq.vocabulary import (
    ADAMW8BIT,
    BF16,
    COMPILE_MODES,
    COMPILED,
    EAGER,
    FSDP,
    HSDP,
    GRADIENT_MODES,
    MASTERS,
    OPTIMIZERS,
    WEIGHT_GATHERS,
)

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
MEMORY_PHASES = ("forward_backward", "backward_start", "offload_backward", "checkpoint_backward",
                 "optimizer_step")  # where a stage's peak is set
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")

class _Part(BaseModel):
    """A section of the plan: fields it does not know are kept (and written back), not refused."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)


class ModelRef(_Part):
    """The model a plan was made for: its name and its `agoq.models.fingerprint`."""

    name: str
    fingerprint: str

    @field_validator("fingerprint")
    @classmethod
    def _hex16(cls, v: str) -> str:
        if not _FINGERPRINT.fullmatch(v):
            raise ValueError(f"must be 16 lower-case hex digits (agoq.models.fingerprint), got {v!r}")
        return v


class ActivationsSpec(_Part):
    """How quantized activations are stored: block size (values per scale), format and rounding."""

    block: int = 128
    format: Literal["int", "nf4"] = "int"
    rounding: Literal["nearest", "stochastic"] = "nearest"

    @model_validator(mode="after")
    def _supported(self) -> "ActivationsSpec":
        check_arguments(4, self.block, self.rounding, self.format)
        return self


class LayerPlan(_Part):
    """One decoder layer: its pipeline stage, whether it is checkpointed whole, whether it is offloaded, and each
    kind's setting.

    Kinds left out are kept at 16 bits. A checkpointed layer keeps only its input and reruns its
    forward in backward, so its kinds must all be 16 (nothing else would be stored). An offloaded layer (since 1.4)
    keeps what it saves for backward (its quantized codes under LAAQ, else bf16; a checkpointed layer: its input) in
    pinned host memory during the step: copied out in forward, back in backward (agoq.runtime.activations.offload).
    """

    layer: int = Field(ge=0)
    stage: int = Field(default=0, ge=0)
    checkpoint: bool = False
    offload: bool = False
    kinds: dict[str, Union[int, str]] = Field(default_factory=dict, validate_default=True)

    @field_validator("kinds")
    @classmethod
    def _settings(cls, v: dict) -> dict:
        out = {k: KEEP for k in KINDS}
        for kind, setting in v.items():
            if isinstance(setting, bool):
                raise ValueError(f"{kind}: setting must be a bit width 2..8, 16 or 'recompute', got {setting!r}")
            out[kind] = check_setting(kind, setting)
        return out

    @model_validator(mode="after")
    def _checkpoint_keeps(self) -> "LayerPlan":
        if self.checkpoint:
            changed = {k: s for k, s in self.kinds.items() if s != KEEP}
            if changed:
                raise ValueError(f"layer {self.layer} is checkpointed (recomputed whole from its input), so its kinds "
                                 f"must all be 16; it sets {changed}")
        return self


class GradientsSpec(_Part):
    """Gradient storage and all-reduce: bf16, 8-bit QuanGrad, or SDP4Bit (sharded, 4-bit traffic)."""

    mode: Literal[GRADIENT_MODES] = "bf16"
    block: int = Field(default=256, ge=1)
    bucket_bytes: int = Field(default=25 * 2**20, ge=1)


class OptimizerSpec(_Part):
    """The optimizer step: torch's AdamW with float32 moments ("adamw") or agoq's fused 8-bit AdamW ("adamw8bit"),
    with float32 master weights ("fp32") or none (bf16 parameters updated with stochastic rounding, adamw8bit only)."""

    name: Literal[OPTIMIZERS] = "adamw"
    master: Literal[MASTERS] = "fp32"

    @model_validator(mode="after")
    def _combination(self) -> "OptimizerSpec":
        if self.master == "none" and self.name != ADAMW8BIT:
            raise ValueError("master 'none' (stochastic rounding of bf16 parameters) needs the adamw8bit optimizer")
        return self


class Figures(_Part):
    """A whole step's figures: step seconds, peak bytes (largest stage) and tokens per second."""

    step_seconds: Optional[float] = Field(default=None, ge=0)
    peak_bytes: Optional[int] = Field(default=None, ge=0)
    tokens_per_second: Optional[float] = Field(default=None, ge=0)


class Alternative(_Part):
    """What the user would otherwise run at the plan's budget: `name` (e.g. "eager selective checkpointing
    (9/16 layers)"), how it runs (compile mode, optimizer, masters, checkpointed and offloaded layers, batch split), its
    predicted figures, measured ones once validated, whether it fits the budget, and the plan's speed-up over
    it (its step seconds / the plan's, predicted and measured)."""

    name: str
    compile: Literal[COMPILE_MODES] = EAGER
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    gradients: str = "bf16"
    micro_batch: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    checkpoint_layers: list[int] = Field(default_factory=list)
    offload_layers: list[int] = Field(default_factory=list)  # layers whose saved tensors go to host memory (1.4): bf16
                                                             # activations, or a checkpointed layer's input
    activation_memory_budget: Optional[float] = None
    predicted: Figures = Field(default_factory=Figures)
    measured: Optional[Figures] = None
    fits: bool = True
    speedup_predicted: Optional[float] = None
    speedup_measured: Optional[float] = None


class Decision(_Part):
    """Why a searched plan is this one: the objective, the caps (the error cap's value and where it came from),
    the constraint that binds ("memory budget", "error cap", "time cap", or "none"), the knob values chosen and
    how many knob combinations were compared."""

    objective: str = "time"
    error_cap: Optional[float] = None
    error_cap_source: Optional[str] = None
    time_cap: Optional[float] = None
    binding: list[str] = Field(default_factory=list)
    knobs: dict[str, Any] = Field(default_factory=dict)
    combinations: int = Field(default=1, ge=0)
    tokens_per_second: Optional[float] = Field(default=None, ge=0)
    reason: Optional[str] = None
    agoq: bool = True  # False: the plan is what a user runs without agoq (its best alternative), said in `reason`


class PipelineSpec(_Part):
    """Pipeline parallelism: number of stages, micro-batches per step and the schedule."""

    stages: int = Field(default=1, ge=1)
    micro_batches: int = Field(default=1, ge=1)
    schedule: Literal[SCHEDULES] = "1f1b"


class ParallelSpec(_Part):
    """The ranks of the run as dimensions (since 1.8; agoq.parallel_dims.ParallelDims): replicate x shard x pipeline
    x tensor ranks, the ranks of a node (None: not fixed) and what shards the state (`engine`: fsdp2, PyTorch's
    FSDP2; None: replicated; sdp4bit, agoq's retired own sharded step, is refused saying what to run instead). Checked by ParallelDims' rules."""

    replicate: int = Field(default=1, ge=1)
    shard: int = Field(default=1, ge=1)
    pipeline: int = Field(default=1, ge=1)
    tensor: int = Field(default=1, ge=1)
    ranks_per_node: Optional[int] = Field(default=None, ge=1)
    engine: Optional[Literal[PLAN_ENGINES]] = None  # sdp4bit (retired): refused by ParallelDims
    # FSDP2's weight all-gather (since 1.9; `agoq train --weight-gather`): int8 / int4 block codes (ZeRO++'s qwZ);
    # None: its own, in bf16. Only with engine fsdp2
    weight_gather: Optional[Literal[WEIGHT_GATHERS]] = None

    @model_validator(mode="after")
    def _valid(self) -> "ParallelSpec":
        dims = self.dims()
        if self.weight_gather not in (None, BF16) and dims.mode not in (FSDP, HSDP):
            raise ValueError(f"parallel.weight_gather: {self.weight_gather} quantizes FSDP2's weight all-gather, and "
                             f"these dims run {dims.mode}: drop it, or give engine fsdp2")
        return self

    @model_serializer(mode="wrap")
    def _without_default_gather(self, handler):
        """Written without `weight_gather` where it is None (FSDP2's own gather): the dims as they were before 1.9."""
        data = handler(self)
        if isinstance(data, dict) and data.get("weight_gather") is None:
            data.pop("weight_gather", None)
        return data

    def dims(self) -> ParallelDims:
        """The section as ParallelDims (ValueError where its rules refuse it)."""
        return ParallelDims(self.replicate, self.shard, self.pipeline, self.tensor, self.ranks_per_node, self.engine)


class TrainingSpec(_Part):
    """The batch shape a plan's figures hold for: micro-batch (sequences), tokens per sequence, accumulation."""

    micro_batch: int = Field(default=1, ge=1)
    seq_len: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    compile: Literal[COMPILE_MODES] = EAGER  # compiled: each decoder layer torch.compile'd (agoq train --compile)
    # torch.compile's partitioner budget (since 1.3, compiled only): it recomputes to keep about this share of the
    # activations (torch._functorch.config.activation_memory_budget; None: 1, keep what it would)
    activation_memory_budget: Optional[float] = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _budget_needs_compile(self) -> "TrainingSpec":
        if self.activation_memory_budget is not None and self.compile != COMPILED:
            raise ValueError("activation_memory_budget is torch.compile's: it needs compile 'compiled'")
        return self


class StageMemory(_Part):
    """One stage's predicted peak part by part (agoq.search.memory_parts, since 1.2): the phase of the step that sets
    it (`layer`: the checkpointed layer, or since 1.7 the offloaded layer, whose backward it is) and the bytes of each
    part then, on one rank of the stage (a sharded part: the rank's shard), adding up to the stage's predicted peak."""

    stage: int = Field(ge=0)
    phase: Literal[MEMORY_PHASES]
    layer: Optional[int] = Field(default=None, ge=0)
    parts: dict[str, int] = Field(default_factory=dict)


class Predicted(_Part):
    """The search's predictions: peak and activation bytes per stage, what each stage's peak is made of, step
    seconds, gradient error, and (since 1.4, with offloaded layers) the pinned host bytes they hold per micro-batch
    and the seconds per step their copies take on the host link."""

    peak_bytes_per_stage: list[int] = Field(default_factory=list)
    activation_bytes_per_stage: list[int] = Field(default_factory=list)
    memory_per_stage: list[StageMemory] = Field(default_factory=list)
    step_seconds: Optional[float] = Field(default=None, ge=0)
    grad_error: Optional[float] = Field(default=None, ge=0)
    compile_graphs: Optional[int] = Field(default=None, ge=0)      # layer graphs torch.compile builds (0: eager)
    compile_seconds: Optional[float] = Field(default=None, ge=0)   # compiling them in a fresh process, once per run
    host_bytes: Optional[int] = Field(default=None, ge=0)  # pinned host bytes the offloaded layers hold per micro-batch
    # seconds per step the offload copies keep the host link busy, out (forward) and back (backward) together
    offload_link_seconds: Optional[float] = Field(default=None, ge=0)

    @field_validator("peak_bytes_per_stage", "activation_bytes_per_stage")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(b < 0 for b in v):
            raise ValueError(f"byte counts must be >= 0, got {v}")
        return v


class Measured(_Part):
    """What a real run measured: peak bytes per stage (None where not measurable, e.g. on a CPU),
    step seconds, loss deviation from bf16 (relative), and when."""

    peak_bytes_per_stage: list[Optional[int]] = Field(default_factory=list)
    step_seconds: Optional[float] = Field(default=None, ge=0)
    loss_deviation: Optional[float] = None
    date: Optional[str] = None


class Source(_Part):
    """Where a plan came from: the method (milp, optuna, ...), its objective, the profile folder and date, and the
    device the profile was measured on (1.6: its GPU's name, or "cpu"; None: not said)."""

    method: str = "manual"
    objective: Optional[str] = None
    profile: Optional[str] = None
    date: Optional[str] = None
    device: Optional[str] = None


__all__ = ["ModelRef", "ActivationsSpec", "LayerPlan", "GradientsSpec", "OptimizerSpec", "Figures", "Alternative",
           "Decision", "PipelineSpec",
           "ParallelSpec", "TrainingSpec", "StageMemory", "Predicted", "Measured", "Source", "SCHEDULES",
           "MEMORY_PHASES"]
