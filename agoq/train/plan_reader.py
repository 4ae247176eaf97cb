"""Reading a plan for training: `agoq.formats.plan` when its validator (pydantic) is installed, else a plain reader.

GPU images often carry only torch. The plain reader checks what training relies on (schema, model
fingerprint, one entry per layer in order, each kind's setting, stages, gradient mode) and gives the
same attributes `agoq.train` uses; the full validation stays in `agoq.formats.plan`.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torch import nn

from agoq.files import read_json_object


class PlainPlan:
    """The parts of a plan.json that training reads, validated without pydantic."""

    def __init__(self, data: dict, where: str):
        from agoq.activations.policy import KEEP, KINDS, check_setting

        schema = data.get("schema")
        if not isinstance(schema, str) or not schema.startswith("agoq.plan/"):
            raise ValueError(f"{where}: schema: expected 'agoq.plan/1', got {schema!r}")
        if not schema.split("/")[1].split(".")[0] == "1":
            raise ValueError(f"{where}: schema: {schema!r} is newer than this agoq reads ('agoq.plan/1')")
        self._data = data
        model = data.get("model") or {}
        self.model = SimpleNamespace(name=model.get("name"), fingerprint=model.get("fingerprint"))
        layers = data.get("layers") or []
        if [lp.get("layer") for lp in layers] != list(range(len(layers))) or not layers:
            raise ValueError(f"{where}: layers: entries must be layers 0..N-1 in order")
        self.layers = []
        for lp in layers:
            kinds = {k: KEEP for k in KINDS}
            kinds.update({k: check_setting(k, v) for k, v in (lp.get("kinds") or {}).items()})
            self.layers.append(SimpleNamespace(layer=lp["layer"], stage=int(lp.get("stage", 0)),
                                               checkpoint=bool(lp.get("checkpoint", False)), kinds=kinds))
        grads = data.get("gradients") or {}
        self.gradients = SimpleNamespace(mode=grads.get("mode", "bf16"))
        pipe = data.get("pipeline") or {}
        self.pipeline = SimpleNamespace(stages=int(pipe.get("stages", 1)),
                                        micro_batches=int(pipe.get("micro_batches", 1)),
                                        schedule=pipe.get("schedule", "1f1b"))
        tr = data.get("training") or {}
        self.training = SimpleNamespace(micro_batch=int(tr.get("micro_batch", 1)), seq_len=int(tr.get("seq_len", 1)),
                                        grad_accum=int(tr.get("grad_accum", 1)))
        pred = data.get("predicted") or {}
        self.predicted = SimpleNamespace(peak_bytes_per_stage=list(pred.get("peak_bytes_per_stage") or []))
        self.budget_bytes = data.get("budget_bytes")
        act = data.get("activations") or {}
        self._act = (int(act.get("block", 128)), act.get("format", "int"), act.get("rounding", "nearest"))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def checkpoint_layers(self) -> list[int]:
        return [lp.layer for lp in self.layers if lp.checkpoint]

    def activation_policy(self):
        from agoq.activations.policy import ActivationPolicy

        block, fmt, rounding = self._act
        return ActivationPolicy(layers={lp.layer: dict(lp.kinds) for lp in self.layers}, block=block, format=fmt,
                                rounding=rounding, name="plan")

    def check_model(self, model: nn.Module) -> None:
        from agoq.models import fingerprint

        found = fingerprint(model)
        if found != self.model.fingerprint:
            raise ValueError(f"model.fingerprint: this plan was made for model {self.model.name!r} (fingerprint "
                             f"{self.model.fingerprint}), not for this one ({found}); profile and search this "
                             "model to get its own plan")

    def apply(self, model: nn.Module) -> None:
        from agoq.activations.checkpointing import apply_checkpointing
        from agoq.activations.laaq import apply_activation_policy

        self.check_model(model)
        apply_activation_policy(model, self.activation_policy())
        if self.checkpoint_layers():
            apply_checkpointing(model, self.checkpoint_layers())

    def to_dict(self) -> dict[str, Any]:
        return self._data


def read_plan(path: str, model: nn.Module):
    """The plan at `path`, checked against `model`: an `agoq.formats.plan.Plan`, or a `PlainPlan` without pydantic."""
    try:
        from agoq.formats.plan import load_plan
    except ImportError:
        load_plan = None
    if load_plan is not None:
        return load_plan(path, model)
    p = Path(path)
    data = read_json_object(p, "plan file")
    plan = PlainPlan(data, str(p))
    try:
        plan.check_model(model)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    return plan


def policy_as_plan(policy, model: nn.Module, gradients: str, micro_batch: int, seq_len: int, grad_accum: int,
                   layer_stage: list[int] | None, stages: int) -> dict[str, Any]:
    """A plan (agoq.plan/1 layout) recording what a run given `--policy` applies, for run.json.

    `source.method` is "policy" and `source.objective` the policy's name; nothing is predicted.
    """
    from agoq.models import fingerprint
    from agoq.activations.saved_bytes import find_decoder_layers

    num_layers = len(find_decoder_layers(model))
    stage_of = layer_stage or [0] * num_layers
    return {
        "schema": "agoq.plan/1",
        "model": {"name": model.config.name, "fingerprint": fingerprint(model)},
        "budget_bytes": None,
        "activations": {"block": policy.block, "format": policy.format, "rounding": policy.rounding},
        "layers": [{"layer": i, "stage": stage_of[i], "checkpoint": False, "kinds": dict(policy.settings(i))}
                   for i in range(num_layers)],
        "gradients": {"mode": gradients, "block": 256, "bucket_bytes": 25 * 2**20},
        "pipeline": {"stages": stages, "micro_batches": grad_accum if stages > 1 else 1, "schedule": "1f1b"},
        "training": {"micro_batch": micro_batch, "seq_len": seq_len, "grad_accum": grad_accum},
        "predicted": {"peak_bytes_per_stage": [], "activation_bytes_per_stage": [], "step_seconds": None,
                      "grad_error": None},
        "measured": None,
        "source": {"method": "policy", "objective": policy.name, "profile": None, "date": None},
    }
