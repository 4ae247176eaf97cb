"""Activation policies: for each decoder layer and tensor kind, how the tensor is kept for backward.

A setting is a bit width 2..8 (block-quantized), 16 (kept as is) or "recompute" (rebuilt in backward
from a tensor that is stored). The kinds, in the order data flows through a LLaMA layer:

  norm_input    the inputs of both RMSNorms (attention and MLP)
  qkv_input     the attention RMSNorm's output = the QKV projections' input   (recomputable)
  attention     q, k, v as attention's backward needs them (16: torch's own SDPA saves them;
                bits: q, k, v quantized and attention's forward run again in backward)
  o_proj_input  the attention output = the output projection's input
  ffn1_input    the MLP RMSNorm's output = the gate/up projections' input       (recomputable)
  silu_input    the gate and up projections' outputs, SiLU(gate) * up's inputs
  ffn2_input    SiLU(gate) * up = the down projection's input                   (recomputable)
"""

from __future__ import annotations

import json
from dataclasses import InitVar, dataclass, field
from typing import Union

from agoq.runtime.quant.layout import MAX_BITS, MIN_BITS
from agoq.runtime.quant.layout import check_arguments

KINDS = ("norm_input", "qkv_input", "attention", "o_proj_input", "ffn1_input", "silu_input", "ffn2_input")
RECOMPUTABLE = {"qkv_input": "norm_input", "ffn1_input": "norm_input", "ffn2_input": "silu_input"}
KEEP = 16
RECOMPUTE = "recompute"
Setting = Union[int, str]


def check_setting(kind: str, setting: Setting) -> Setting:
    """Validate one kind's setting; returns it normalised (ints as int, 'recompute' as str)."""
    if kind not in KINDS:
        raise ValueError(f"unknown tensor kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if setting == RECOMPUTE:
        if kind not in RECOMPUTABLE:
            raise ValueError(f"{kind} cannot be recomputed; only {', '.join(RECOMPUTABLE)} can "
                             "(each from a stored tensor): give it a bit width 2..8 or 16")
        return RECOMPUTE
    if isinstance(setting, str) and setting.isdigit():
        setting = int(setting)
    if isinstance(setting, bool) or not isinstance(setting, int) or \
            not (MIN_BITS <= setting <= MAX_BITS or setting == KEEP):
        raise ValueError(f"{kind}: setting must be a bit width {MIN_BITS}..{MAX_BITS}, 16 (keep) or "
                         f"'recompute', got {setting!r}")
    return setting


@dataclass
class ActivationPolicy:
    """Per-layer, per-kind settings: `default` for every layer, `layers` overriding single layers.

    `block`, `format` ("int" or "nf4", the latter for 4-bit settings) and `rounding` apply to every
    quantized tensor. Every setting is checked here, once: what applies the policy trusts it. `checked=True` says
    the settings were checked where they were read (a loaded plan's: `agoq.formats.plan.Plan.activation_policy`)
    and are complete (`default` names every kind): they are taken as they are.
    """

    default: dict[str, Setting] = field(default_factory=lambda: {k: KEEP for k in KINDS})
    layers: dict[int, dict[str, Setting]] = field(default_factory=dict)
    block: int = 128
    format: str = "int"
    rounding: str = "nearest"
    name: str = "custom"
    checked: InitVar[bool] = False

    def __post_init__(self, checked: bool) -> None:
        if checked:
            return
        full = {k: KEEP for k in KINDS}
        full.update(self.default)
        self.default = {k: check_setting(k, v) for k, v in full.items()}
        self.layers = {int(i): {k: check_setting(k, v) for k, v in over.items()}
                       for i, over in self.layers.items()}
        for i in self.layers:
            if i < 0:
                raise ValueError(f"layer index must be >= 0, got {i}")
        check_arguments(4, self.block, self.rounding, self.format)

    def settings(self, layer: int) -> dict[str, Setting]:
        """The full kind -> setting map of one layer."""
        out = dict(self.default)
        out.update(self.layers.get(layer, {}))
        return out

    def keeps_everything(self, layer: int) -> bool:
        """True when the layer stores every kind in 16 bits: it runs unmodified."""
        return all(v == KEEP for v in self.settings(layer).values())

    def to_dict(self) -> dict:
        """A JSON-ready dict that `from_dict` reads back."""
        return {"name": self.name, "block": self.block, "format": self.format, "rounding": self.rounding,
                "default": dict(self.default), "layers": {str(i): dict(v) for i, v in sorted(self.layers.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "ActivationPolicy":
        """Build a policy from `to_dict`'s form; raises ValueError naming the bad field."""
        unknown = set(d) - {"name", "block", "format", "rounding", "default", "layers"}
        if unknown:
            raise ValueError(f"unknown policy field(s) {sorted(unknown)}")
        return cls(default=dict(d.get("default", {})), layers={int(i): v for i, v in d.get("layers", {}).items()},
                   block=d.get("block", 128), format=d.get("format", "int"), rounding=d.get("rounding", "nearest"),
                   name=d.get("name", "custom"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _paper_default(bits: int) -> dict[str, Setting]:
    return {"norm_input": bits, "qkv_input": RECOMPUTE, "attention": KEEP, "o_proj_input": bits,
            "ffn1_input": RECOMPUTE, "silu_input": bits, "ffn2_input": RECOMPUTE}


def _uniform(bits: int) -> dict[str, Setting]:
    return {k: bits for k in KINDS}


PRESET_NAMES = ("bf16", "agoq-paper", "int8", "int4", "int2")


def preset(name: str, **options) -> ActivationPolicy:
    """A built-in policy by name.

    bf16        nothing changes (every layer runs unmodified)
    agoq-paper  LAAQ as published: norm inputs, o_proj input and SiLU*Mul input at 4 bits,
                attention kept, the norm outputs and SwiGLU output recomputed
    int8/int4/int2  every kind stored at that width, nothing recomputed
    `options` (block, format, rounding) are passed to the policy.
    """
    if name == "bf16":
        return ActivationPolicy(name=name, **options)
    if name == "agoq-paper":
        return ActivationPolicy(default=_paper_default(4), name=name, **options)
    if name in ("int8", "int4", "int2"):
        return ActivationPolicy(default=_uniform(int(name[3:])), name=name, **options)
    raise ValueError(f"unknown activation policy preset {name!r}; presets: {', '.join(PRESET_NAMES)}")


def stage_bits(in_flight: list[int], base_bits: int = 4) -> list[int]:
    """Bits per pipeline stage from in-flight micro-batch counts: B_i = max(4, floor(4 * N_1 / N_i)), <= 8.

    Rounding down keeps every stage's activation memory at or below stage 1's. For the counts
    (11, 9, 7, 5) of 4 stages x 8 micro-batches this gives (4, 4, 6, 8); the paper reports 5 bits for
    stage 2, which would hold 9 x 5 = 45 units against stage 1's 11 x 4 = 44.
    """
    if not in_flight or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in in_flight):
        raise ValueError(f"in_flight must be a non-empty list of positive integers, got {in_flight!r}")
    first = in_flight[0]
    return [min(MAX_BITS, max(base_bits, (base_bits * first) // n)) for n in in_flight]


def split_layers(num_layers: int, num_stages: int) -> list[int]:
    """The stage of each layer when `num_layers` are cut into `num_stages` contiguous, near-equal stages."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    return [i * num_stages // num_layers for i in range(num_layers)]


def stage_aware_policy(in_flight: list[int], num_layers: int, layer_stage: list[int] | None = None,
                       **options) -> ActivationPolicy:
    """agoq-paper with each stage's quantized kinds at `stage_bits(in_flight)` bits.

    `in_flight[i]` is the number of micro-batches whose activations stage i holds at its peak (e.g.
    from the 1F1B schedule); layers are split evenly over the stages unless `layer_stage` is given.
    """
    bits = stage_bits(in_flight)
    stages = layer_stage if layer_stage is not None else split_layers(num_layers, len(in_flight))
    if len(stages) != num_layers or any(not 0 <= s < len(in_flight) for s in stages):
        raise ValueError(f"layer_stage must give a stage in 0..{len(in_flight) - 1} for each of {num_layers} layers")
    layers = {i: _paper_default(bits[s]) for i, s in enumerate(stages)}
    return ActivationPolicy(default=_paper_default(4), layers=layers,
                            name="stage-aware-" + "-".join(map(str, bits)), **options)


def as_policy(policy: "ActivationPolicy | str | dict") -> ActivationPolicy:
    """Accept a policy, a preset name, or a dict in `ActivationPolicy.to_dict` form."""
    if isinstance(policy, ActivationPolicy):
        return policy
    if isinstance(policy, str):
        return preset(policy)
    if isinstance(policy, dict):
        return ActivationPolicy.from_dict(policy)
    raise TypeError(f"policy must be an ActivationPolicy, a preset name or a dict, got {type(policy).__name__}")
