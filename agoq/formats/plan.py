"""The Plan: what `agoq search` decides and `agoq train` applies (schema ``agoq.plan/1.7``, docs/formats.md).

A plan says, for one model (by fingerprint), how each decoder layer keeps each tensor kind for
backward (a bit width 2..8, 16, or "recompute"), which layers are checkpointed whole, how gradients are
stored and all-reduced, the optimizer and its masters, the compile mode, the pipeline stage of each layer,
the memory budget it was made for, and the predicted (and, once validated, measured) peak memory per
stage, step time and gradient error. Since 1.1 a searched plan also says why it was chosen (`decision`:
objective, caps, the binding constraint, the knob values) and what it beats (`alternative`: the fastest
of bf16, checkpointing and torch.compile's memory budget that fits the same budget). Since 1.2 it says what each
stage's predicted peak is made of (`predicted.memory_per_stage`). 1.0 plans load unchanged (eager, AdamW with
float32 masters, nothing about the decision); 1.0 and 1.1 plans have no memory parts. Since 1.3 a compiled plan
may give torch.compile's partitioner budget (`training.activation_memory_budget`). Since 1.4 a layer may be offloaded
(`layers[*].offload`: its saved tensors kept in pinned host memory during the step), the plan may say the host
memory it was made for (`host_budget_bytes`), and the prediction what offload holds and moves
(`predicted.host_bytes`, `predicted.offload_link_seconds`); plans before 1.4 offload nothing and load unchanged.
Since 1.5 a stage's peak may be set at the start of backward (memory phase `backward_start`: with offloaded
layers, backward's first prefetch in flight). Since 1.6 a searched plan names the device its profile was measured on
(`source.device`, e.g. "NVIDIA H200"), which `agoq train --plan` compares with its own. Since 1.7 a stage's peak
may be set in the backward of an offloaded layer (memory phase `offload_backward`, with its `layer` where it is
layer 0 or 1; memory part `offload_backward`).

    plan = load_plan("plan.json", model)   # validates; refuses a plan made for another model
    plan.activation_policy()               # what the runtime applies: agoq.train.apply.apply_plan
    plan.save("plan.json")                 # atomic

Unknown fields are kept and written back (formats grow additively); unknown schema kinds, newer major
versions, impossible values and plans for another model are refused with an error naming the field. A plan is
data: this module reads, checks and writes it, and changes no model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agoq.activations.policy import (
    KEEP,
    KINDS,
    ActivationPolicy,
    Setting,
    check_setting,
)
from agoq.files import read_json_object
from agoq.layout import GRADIENT_MODES
from agoq.quant.layout import check_arguments

SCHEMA = "agoq.plan/1.7"
SCHEMA_KIND = "agoq.plan"
SCHEMA_MAJOR = 1
SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
MEMORY_PHASES = ("forward_backward", "backward_start", "offload_backward", "checkpoint_backward",
                 "optimizer_step")  # where a stage's peak is set
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
NO_OFFLOAD_PARALLEL = ("fsdp", "pipeline")  # launch.parallel modes offload cannot run in (agoq.train.preparation)


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
    pinned host memory during the step: copied out in forward, back in backward (agoq.activations.offload).
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

    mode: Literal["bf16", "quangrad8", "sdp4bit"] = "bf16"
    block: int = Field(default=256, ge=1)
    bucket_bytes: int = Field(default=25 * 2**20, ge=1)


class OptimizerSpec(_Part):
    """The optimizer step: torch's AdamW with float32 moments ("adamw") or agoq's fused 8-bit AdamW ("adamw8bit"),
    with float32 master weights ("fp32") or none (bf16 parameters updated with stochastic rounding, adamw8bit only)."""

    name: Literal["adamw", "adamw8bit"] = "adamw"
    master: Literal["fp32", "none"] = "fp32"

    @model_validator(mode="after")
    def _combination(self) -> "OptimizerSpec":
        if self.master == "none" and self.name != "adamw8bit":
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
    compile: Literal["eager", "compiled"] = "eager"
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
    schedule: Literal["1f1b", "interleaved-1f1b", "gpipe"] = "1f1b"


class TrainingSpec(_Part):
    """The batch shape a plan's figures hold for: micro-batch (sequences), tokens per sequence, accumulation."""

    micro_batch: int = Field(default=1, ge=1)
    seq_len: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    compile: Literal["eager", "compiled"] = "eager"  # compiled: each decoder layer torch.compile'd (agoq train --compile)
    # torch.compile's partitioner budget (since 1.3, compiled only): it recomputes to keep about this share of the
    # activations (torch._functorch.config.activation_memory_budget; None: 1, keep what it would)
    activation_memory_budget: Optional[float] = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _budget_needs_compile(self) -> "TrainingSpec":
        if self.activation_memory_budget is not None and self.compile != "compiled":
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


class Plan(_Part):
    """A validated plan (see the module docstring and docs/formats.md)."""

    schema_: str = Field(default=SCHEMA, alias="schema")
    model: ModelRef
    budget_bytes: Optional[int] = Field(default=None, ge=1)
    host_budget_bytes: Optional[int] = Field(default=None, ge=1)  # pinned host memory the plan was made for (1.4)
    activations: ActivationsSpec = Field(default_factory=ActivationsSpec)
    layers: list[LayerPlan]
    gradients: GradientsSpec = Field(default_factory=GradientsSpec)
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    predicted: Predicted = Field(default_factory=Predicted)
    measured: Optional[Measured] = None
    source: Source = Field(default_factory=Source)
    decision: Optional[Decision] = None
    alternative: Optional[Alternative] = None       # the fastest alternative that fits the budget (None: none fits)
    alternatives: list[Alternative] = Field(default_factory=list)  # every alternative priced, fitting or not

    model_config = ConfigDict(extra="allow", validate_assignment=True, populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: str) -> str:
        m = re.fullmatch(r"([a-z_.]+)/(\d+)(?:\.\d+)*", v)
        if not m or m.group(1) != SCHEMA_KIND:
            raise ValueError(f"{v!r} is not a plan schema (expected {SCHEMA!r})")
        if int(m.group(2)) > SCHEMA_MAJOR:
            raise ValueError(f"{v!r} is newer than this agoq reads ({SCHEMA!r}): upgrade agoq")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        indices = [lp.layer for lp in self.layers]
        if not indices:
            raise ValueError("layers: a plan needs at least one layer")
        if indices != list(range(len(indices))):
            raise ValueError(f"layers: entries must be layers 0..{len(indices) - 1} in order, got {indices}")
        stages = [lp.stage for lp in self.layers]
        n = self.pipeline.stages
        bad = [lp.layer for lp in self.layers if lp.stage >= n]
        if bad:
            raise ValueError(f"layers: layer(s) {bad} have a stage >= pipeline.stages ({n})")
        if stages != sorted(stages) or set(stages) != set(range(n)):
            raise ValueError(f"layers[*].stage: pipeline stages must hold contiguous runs of layers and each of the "
                             f"{n} stage(s) at least one layer, got {stages}")
        for name in ("peak_bytes_per_stage", "activation_bytes_per_stage"):
            values = getattr(self.predicted, name)
            if values and len(values) != n:
                raise ValueError(f"predicted.{name}: {len(values)} value(s) for {n} pipeline stage(s)")
        self._memory_adds_up(n)
        self._offload_runs(n)
        if self.measured is not None and self.measured.peak_bytes_per_stage \
                and len(self.measured.peak_bytes_per_stage) != n:
            raise ValueError(f"measured.peak_bytes_per_stage: {len(self.measured.peak_bytes_per_stage)} value(s) "
                             f"for {n} pipeline stage(s)")
        return self

    def _offload_runs(self, stages: int) -> None:
        """Offloaded layers only where the runtime offloads (one process, ddp or sharded), within the host budget."""
        offloaded = self.offload_layers()
        if offloaded and stages > 1:
            raise ValueError(f"layers[*].offload: layer(s) {offloaded} are offloaded in a pipeline of {stages} stages; "
                             "the runtime offloads in one process, ddp or sharded only: offload no layer, or "
                             "make the plan for one stage")
        launch = (self.model_extra or {}).get("launch")
        parallel = launch.get("parallel") if isinstance(launch, dict) else None
        if offloaded and parallel in NO_OFFLOAD_PARALLEL:
            raise ValueError(f"layers[*].offload: layer(s) {offloaded} are offloaded, but launch.parallel is "
                             f"{parallel!r}; the runtime offloads in one process, ddp or sharded only: offload no "
                             "layer, or launch the plan in one of those modes")
        host, budget = self.predicted.host_bytes, self.host_budget_bytes
        if host is not None and budget is not None and host > budget:
            raise ValueError(f"predicted.host_bytes: the offloaded layers hold {host} bytes of pinned host memory, "
                             f"more than the plan's host_budget_bytes ({budget}): offload fewer layers, or make the "
                             "plan for a larger host budget")

    def _memory_adds_up(self, stages: int) -> None:
        memory, peaks = self.predicted.memory_per_stage, self.predicted.peak_bytes_per_stage
        if not memory:
            return
        if [m.stage for m in memory] != list(range(stages)):
            raise ValueError(f"predicted.memory_per_stage: one entry per pipeline stage 0..{stages - 1} in order, "
                             f"got stages {[m.stage for m in memory]}")
        for m in memory:
            if peaks and sum(m.parts.values()) != peaks[m.stage]:
                raise ValueError(f"predicted.memory_per_stage[{m.stage}].parts: add up to {sum(m.parts.values())} "
                                 f"bytes, the stage's predicted peak is {peaks[m.stage]}")
            if (m.phase == "checkpoint_backward" and m.layer is None) or \
                    (m.layer is not None and m.phase not in ("checkpoint_backward", "offload_backward")):
                raise ValueError(f"predicted.memory_per_stage[{m.stage}].layer: a layer is given with phase "
                                 "checkpoint_backward (always) and offload_backward (where it is an offloaded layer's "
                                 "backward), and only with them")

    # ------------------------------------------------------------------ reading the plan

    @property
    def num_layers(self) -> int:
        """Number of decoder layers the plan covers."""
        return len(self.layers)

    def settings(self, layer: int) -> dict[str, Setting]:
        """The kind -> setting map of one layer as the plan states it (checkpointed layers: all 16)."""
        return dict(self.layers[layer].kinds)

    @property
    def schema_version(self) -> tuple[int, int]:
        """(major, minor) of the plan's schema: (1, 0) for "agoq.plan/1" and "agoq.plan/1.0"."""
        parts = [int(x) for x in self.schema_.split("/", 1)[1].split(".")]
        return parts[0], parts[1] if len(parts) > 1 else 0

    def states_run_settings(self) -> dict[str, bool]:
        """Which of the settings added in 1.1 the plan states: "optimizer" (its `optimizer` section) and "compile"
        (`training.compile`). A 1.0 plan states neither (even when written back with the defaults filled in);
        a 1.1 plan states what it has."""
        newer = self.schema_version >= (1, 1)
        return {"optimizer": newer and "optimizer" in self.model_fields_set,
                "compile": newer and "compile" in self.training.model_fields_set}

    def checkpoint_layers(self) -> list[int]:
        """Indices of the layers recomputed whole in backward (activation checkpointing)."""
        return [lp.layer for lp in self.layers if lp.checkpoint]

    def offload_layers(self) -> list[int]:
        """Indices of the layers whose saved tensors are kept in pinned host memory during the step (since 1.4)."""
        return [lp.layer for lp in self.layers if lp.offload]

    def activation_policy(self) -> ActivationPolicy:
        """The runtime's ActivationPolicy: per-layer settings with the plan's block, format and rounding.

        Checkpointed layers are all 16 in it, so they run their own forward inside the checkpoint. The settings
        were checked when the plan was (each kind's in `LayerPlan`, the storage in `ActivationsSpec`): the policy
        takes them as they are.
        """
        layers = {lp.layer: dict(lp.kinds) for lp in self.layers}
        return ActivationPolicy(default={k: KEEP for k in KINDS}, layers=layers, block=self.activations.block,
                                format=self.activations.format, rounding=self.activations.rounding,
                                name=f"plan-{self.source.method}", checked=True)

    def check_model(self, model) -> None:
        """Raise ValueError unless `model` (an nn.Module or a fingerprint string) is the plan's model."""
        if isinstance(model, str):
            found = model
        else:
            from agoq.models import fingerprint

            found = fingerprint(model)
        if found != self.model.fingerprint:
            raise ValueError(f"model.fingerprint: this plan was made for model {self.model.name!r} "
                             f"(fingerprint {self.model.fingerprint}), not for this one ({found}); "
                             "profile and search this model to get its own plan")

    # ------------------------------------------------------------------ writing

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data, in the documented layout."""
        return self.model_dump(mode="json", by_alias=True)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan as JSON, atomically; returns the path."""
        from agoq.files import write_json

        return write_json(path, self.to_dict())


def _field_name(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = "schema" if part == "schema_" else part
            out += f".{part}" if out else str(part)
    return out or "(plan)"


def _readable(error: ValidationError, where: str) -> str:
    lines = []
    for e in error.errors():
        msg = e["msg"]
        msg = msg[len("Value error, "):] if msg.startswith("Value error, ") else msg
        lines.append(f"{_field_name(tuple(e['loc']))}: {msg}")
    return f"{where}: invalid plan: " + "; ".join(lines)


def plan_from_dict(data: Any, where: str = "plan") -> Plan:
    """Validate JSON-ready data as a Plan; raises ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a plan is a JSON object, got {type(data).__name__}")
    if "schema" not in data:
        raise ValueError(f"{where}: schema: missing (expected {SCHEMA!r})")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise ValueError(_readable(e, where)) from None


def load_plan(path: str | os.PathLike, model=None) -> Plan:
    """Read and validate `plan.json`; with `model` (an nn.Module or fingerprint), also check it is that model's.

    Raises FileNotFoundError for a missing file and ValueError, naming the field, for anything invalid.
    """
    path = Path(path)
    plan = plan_from_dict(read_json_object(path, "plan file"), str(path))
    if model is not None:
        try:
            plan.check_model(model)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return plan


def is_plan_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a file holding a JSON object whose schema is a plan's ("agoq.plan/N", any version): what
    `agoq search` writes, and so may replace. Unreadable, not JSON or another schema: False."""
    try:
        data = read_json_object(path, "plan file")
    except (OSError, ValueError):
        return False
    schema = data.get("schema")
    return isinstance(schema, str) and schema.startswith(SCHEMA_KIND + "/")


__all__ = ["SCHEMA", "Plan", "LayerPlan", "ModelRef", "ActivationsSpec", "GradientsSpec", "PipelineSpec",
           "TrainingSpec", "Predicted", "StageMemory", "Measured", "Source", "OptimizerSpec", "Decision", "Alternative",
           "Figures", "load_plan", "plan_from_dict", "is_plan_file", "GRADIENT_MODES", "SCHEDULES", "MEMORY_PHASES",
           "NO_OFFLOAD_PARALLEL"]
