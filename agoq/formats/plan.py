"""The Plan: what `agoq search` decides and `agoq train` applies (schema ``agoq.plan/1.9``, docs/formats.md).

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
layer 0 or 1; memory part `offload_backward`). Since 1.8 a plan gives its ranks as dimensions (`parallel`:
replicate, shard, pipeline, tensor, ranks_per_node, engine; agoq.parallel_dims.ParallelDims), and its `launch` is
derived from them; a plan before 1.8 has its `launch` read into them on load. Since 1.9 a plan made for a cluster
its profile was not measured on says so (`whatif`, agoq.formats.plan_whatif: measured vs planned world, the
network, what is extrapolated, what to run first on the real cluster), and `parallel.weight_gather` may say FSDP2
gathers its weights as int8 (or int4) block codes (`agoq train --weight-gather`), which its launch says.

    plan = load_plan("plan.json", model)   # validates; refuses a plan made for another model
    plan.activation_policy()               # what the runtime applies: agoq.train.apply.apply_plan
    plan.save("plan.json")                 # atomic

Unknown fields are kept and written back (formats grow additively); unknown schema kinds, newer major
versions, impossible values and plans for another model are refused with an error naming the field. A plan is
data: this module reads, checks and writes it, and changes no model. Its sections (and the words they accept,
agoq.vocabulary's) are agoq.formats.plan_sections, re-exported here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agoq.runtime.activations.policy import KEEP, KINDS, ActivationPolicy, Setting
from agoq.files import read_json_object
from agoq.formats.plan_sections import (
    MEMORY_PHASES,
    SCHEDULES,
    ActivationsSpec,
    Alternative,
    Decision,
    Figures,
    GradientsSpec,
    LayerPlan,
    Measured,
    ModelRef,
    OptimizerSpec,
    ParallelSpec,
    PipelineSpec,
    Predicted,
    Source,
    StageMemory,
    TrainingSpec,
    _Part,
)
from agoq.formats.plan_whatif import WhatIf
from agoq.parallel_dims import ParallelDims, launch_of
from agoq.vocabulary import FSDP, GRADIENT_MODES, HSDP, PIPELINE

SCHEMA = "agoq.plan/1.9"
SCHEMA_KIND = "agoq.plan"
SCHEMA_MAJOR = 1
NO_OFFLOAD_PARALLEL = (FSDP, HSDP, PIPELINE)  # launch.parallel modes offload cannot run in (agoq.train.preparation)


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
    parallel: Optional[ParallelSpec] = None  # the ranks as dimensions (1.8; before: read from `launch`)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    predicted: Predicted = Field(default_factory=Predicted)
    measured: Optional[Measured] = None
    source: Source = Field(default_factory=Source)
    decision: Optional[Decision] = None
    alternative: Optional[Alternative] = None       # the fastest alternative that fits the budget (None: none fits)
    alternatives: list[Alternative] = Field(default_factory=list)  # every alternative priced, fitting or not
    whatif: Optional[WhatIf] = None  # made for a cluster the profile was not measured on (1.9; None: its own world)

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
        self._parallel_agrees(n)
        self._memory_adds_up(n)
        self._offload_runs(n)
        if self.measured is not None and self.measured.peak_bytes_per_stage \
                and len(self.measured.peak_bytes_per_stage) != n:
            raise ValueError(f"measured.peak_bytes_per_stage: {len(self.measured.peak_bytes_per_stage)} value(s) "
                             f"for {n} pipeline stage(s)")
        return self

    def _parallel_agrees(self, stages: int) -> None:
        """The dims (`parallel`) taken from `launch` where a plan before 1.8 has only that, checked against the
        pipeline's stages, a `launch` given beside them and (1.8 on) the decision's layout knob; `launch` is then
        derived from them (the command that runs the plan)."""
        extra = self.model_extra if self.model_extra is not None else {}
        launch = extra.get("launch")
        launch = launch if isinstance(launch, dict) else None
        stated = self.parallel is not None
        if not stated:
            if launch is None or not launch.get("parallel"):
                return
            self.__dict__["parallel"] = ParallelSpec(**ParallelDims.of_launch(launch).to_dict())
        dims = self.parallel.dims()
        if dims.pipeline != stages:
            raise ValueError(f"parallel.pipeline: {dims.pipeline} stage(s), pipeline.stages says {stages}: give both "
                             "the same number of stages")
        if stated and launch is not None and (launch.get("parallel") != dims.mode
                                              or int(launch.get("processes") or 1) != dims.world_size):
            raise ValueError(f"launch: parallel {launch.get('parallel')!r} over {launch.get('processes')} process(es) "
                             f"contradicts the plan's parallel dims ({dims.describe()}: {dims.mode} over "
                             f"{dims.world_size}); launch is derived from parallel: drop it, or make them agree")
        knob = ((self.decision.knobs if self.decision is not None else {}) or {}).get("layout")
        if knob is not None and self.schema_version >= (1, 8) and knob != dims.layout:
            raise ValueError(f"decision.knobs.layout: the decision says layout {knob}, the plan's parallel dims are "
                             f"{dims.describe()} (layout {dims.layout}): the plan must launch what was decided; "
                             "re-run `agoq search`, or make them agree")
        extra["launch"] = launch_of(dims, self.gradients.mode, self.parallel.weight_gather)

    def dims(self) -> Optional[ParallelDims]:
        """The plan's ranks as dimensions (its `parallel`, or its `launch` before 1.8); None: the plan says none
        (1.0 plans, a policy's record)."""
        return None if self.parallel is None else self.parallel.dims()

    def _offload_runs(self, stages: int) -> None:
        """Offloaded layers only where the runtime offloads (one process or ddp), within the host budget."""
        offloaded = self.offload_layers()
        if offloaded and stages > 1:
            raise ValueError(f"layers[*].offload: layer(s) {offloaded} are offloaded in a pipeline of {stages} stages; "
                             "the runtime offloads in one process or ddp only: offload no layer, or "
                             "make the plan for one stage")
        parallel = self.parallel.dims().mode if self.parallel is not None else None
        if offloaded and parallel in NO_OFFLOAD_PARALLEL:
            raise ValueError(f"layers[*].offload: layer(s) {offloaded} are offloaded, but the plan's parallel mode is "
                             f"{parallel!r}; the runtime offloads in one process or ddp only: offload no "
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


def new_plan(model: Any, layers: list, where: str = "plan", **sections: Any) -> Plan:
    """A new plan in this schema (SCHEMA) from its model reference, its layers and any other sections (each a section
    model or its JSON data; those not given take their defaults), validated: the one way agoq's stages make a plan
    (the search's `build_plan`, the trainer's record of a policy run, the plan one process measures). Raises
    ValueError naming the bad field, prefixed with `where`."""
    return plan_from_dict({**sections, "schema": SCHEMA, "model": model, "layers": layers}, where)


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
           "ParallelSpec", "TrainingSpec", "Predicted", "StageMemory", "Measured", "Source", "OptimizerSpec",
           "Decision", "Alternative", "Figures", "WhatIf", "load_plan", "plan_from_dict", "new_plan", "is_plan_file",
           "GRADIENT_MODES", "SCHEDULES",
           "MEMORY_PHASES", "NO_OFFLOAD_PARALLEL"]
