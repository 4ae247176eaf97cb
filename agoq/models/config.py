"""What model to build: ``LlamaConfig`` (shape and numerics, field names as HF ``config.json``), the families it
reads (LLaMA, Qwen2, Mistral), the presets, and ``resolve_config`` to turn a model spec (a preset name, a
config.json path, a dict or a config) into a config.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from agoq.files import read_json_object
from agoq.models.rope_scaling import check_rope_scaling_fits, normalize_rope_scaling


@dataclass
class LlamaConfig:
    """Shape and numerics of a LLaMA model; field names follow HF ``config.json``."""

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None  # None: same as num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    name: str = "custom"
    # None: plain RoPE; else a normalised rope scaling dict (agoq.models.rope), e.g. Llama 3.1+'s "llama3"
    rope_scaling: dict[str, Any] | None = None
    # "llama", or a family this model builds exactly: "qwen2" (LLaMA with q/k/v biases) or "mistral"
    # (LLaMA; its sliding window is accepted only where it never masks anything, see from_dict)
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "max_position_embeddings"):
            _check_positive_int(f, getattr(self, f))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_positive_int("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); pick a kv head count "
                f"that divides the head count")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_attention_heads ({self.num_attention_heads}) when head_dim is not "
                    f"given; change one of them or set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: rotary embeddings "
                             f"rotate pairs of dimensions")
        for f in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{f} must be a positive number, got {v!r}")
            setattr(self, f, float(v))
        v = self.initializer_range
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"initializer_range must be a number >= 0, got {v!r}")
        self.initializer_range = float(v)
        for f in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be true or false, got {getattr(self, f)!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}, got {self.model_type!r}")
        if self.model_type != "llama" and (self.attention_bias or self.mlp_bias):
            raise ValueError(f"attention_bias and mlp_bias must be false for model_type {self.model_type!r}: "
                             f"its biases are fixed by the family (qwen2: q/k/v only; mistral: none)")
        if self.rope_scaling is not None:
            self.rope_scaling = normalize_rope_scaling(
                self.rope_scaling, where="rope_scaling", max_position_embeddings=self.max_position_embeddings)
            check_rope_scaling_fits(self.rope_scaling, self.head_dim)

    @property
    def qkv_bias(self) -> bool:
        """Whether q_proj, k_proj and v_proj carry biases (o_proj has one only with attention_bias)."""
        return self.attention_bias or self.model_type == "qwen2"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build a config from a HuggingFace-style ``config.json`` dict or a dict of our fields.

        Known keys are taken, harmless HF bookkeeping keys and unknown keys are ignored.
        ``model_type`` may be "llama", "qwen2" or "mistral" (keys a file leaves out take that family's
        transformers default). RoPE scaling is read from ``rope_scaling`` (older files) or
        ``rope_parameters`` (transformers >= 5); see ``agoq.models.rope`` for the supported types.
        Features this model does not implement (another model_type, a non-SiLU activation,
        attention dropout, another RoPE scaling, a sliding window that would mask anything) raise
        instead of being silently dropped.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a dict of config fields, got {type(d).__name__}")
        model_type = d.get("model_type") or "llama"
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported: this reference model is LLaMA and the "
                f"families that are LLaMA with small changes (model_type {', '.join(map(repr, MODEL_TYPES))})")
        act = d.get("hidden_act")
        if act is not None and act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported: LLaMA uses 'silu'")
        drop = d.get("attention_dropout")
        if drop not in (None, 0, 0.0):
            raise ValueError(f"attention_dropout must be 0, got {drop!r}: this model has no dropout")

        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "model_type"}
        kwargs = {**_FAMILY_DEFAULTS.get(model_type, {}), **{k: v for k, v in d.items() if k in fields}}
        kwargs["model_type"] = model_type
        if model_type != "llama":
            # transformers' Qwen2 / Mistral fix their biases and ignore these keys; so do we
            kwargs.pop("attention_bias", None)
            kwargs.pop("mlp_bias", None)
            _check_sliding_window(d, model_type, kwargs.get("max_position_embeddings", 4096),
                                  kwargs.get("num_hidden_layers", 16))
        # transformers >= 5 writes rope_parameters = {"rope_type": ..., "rope_theta": ...};
        # older files write rope_theta at top level plus an optional rope_scaling dict.
        # As in transformers, a non-empty rope_scaling wins over rope_parameters.
        key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        rope = d.get(key)
        if rope is not None:
            max_pos = kwargs.get("max_position_embeddings", 4096)
            kwargs["rope_scaling"] = normalize_rope_scaling(
                rope, where=key, max_position_embeddings=max_pos if isinstance(max_pos, int) else 4096,
                original_max_position_embeddings=d.get("original_max_position_embeddings"))
            if "rope_theta" in rope and "rope_theta" not in d:
                kwargs["rope_theta"] = rope["rope_theta"]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict, readable by ``from_dict`` (and by HF)."""
        d = dataclasses.asdict(self)
        if self.model_type != "llama":
            d["sliding_window"] = None  # Mistral's default is a 4096-token window; this model has none
        return d

    def num_parameters(self) -> int:
        """Parameter count of the model this config describes (tied weights counted once)."""
        C, D, L = self.hidden_size, self.head_dim, self.num_hidden_layers
        H, Hkv, I, V = self.num_attention_heads, self.num_key_value_heads, self.intermediate_size, self.vocab_size
        attn = C * H * D * 2 + C * Hkv * D * 2
        if self.qkv_bias:
            attn += H * D + 2 * Hkv * D
        if self.attention_bias:
            attn += C
        mlp = 3 * C * I + ((2 * I + C) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * C
        return V * C * (1 if self.tie_word_embeddings else 2) + L * per_layer + C


MODEL_TYPES = ("llama", "qwen2", "mistral")

# transformers' defaults for keys a Qwen2 / Mistral config.json leaves out, where they differ from ours
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-6),
}


def _check_sliding_window(d: dict[str, Any], model_type: str, max_positions: Any, num_layers: Any) -> None:
    """Refuse a sliding attention window that could mask anything: this model attends over the whole causal
    prefix. A window of at least max_position_embeddings never masks (training refuses longer sequences)."""
    if model_type == "mistral":
        window = d.get("sliding_window", 4096)  # transformers' Mistral default when the key is missing
        where = "sliding_window"
    else:  # qwen2: only with use_sliding_window, and only on the layers listed as sliding
        if not d.get("use_sliding_window", False):
            return
        window = d.get("sliding_window", 4096)
        types = d.get("layer_types")
        if types is None and isinstance(num_layers, int):
            first = d.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if window is None or "sliding_attention" not in (types or []):
            return
        where = "use_sliding_window with sliding_window"
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    if isinstance(max_positions, int) and max_positions > window:
        raise NotImplementedError(
            f"model_type {model_type!r}: {where} {window} is smaller than max_position_embeddings "
            f"({max_positions}), so attention would be limited to the last {window} tokens, which this model "
            f"does not implement (it attends over the whole causal prefix); set max_position_embeddings to at "
            f"most {window} (training then never uses longer sequences) or sliding_window to null")


def _check_positive_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")


PRESETS: dict[str, LlamaConfig] = {
    # tiny model for CPU tests
    "llama-tiny": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        name="llama-tiny"),
    # ~1.1B TinyLlama-like probe shape (no GQA)
    "probe": LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
        rope_theta=10000.0, name="probe"),
    # as the real config.json, including its "llama3" rope scaling
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, name="llama-3.2-1b"),
    # the original Llama-3-8B (not 3.1), which has no rope scaling
    "llama-3-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, name="llama-3-8b"),
}


ModelSpec = Union[str, os.PathLike, dict, LlamaConfig]


def _load_json_config(path: Path) -> LlamaConfig:
    d = read_json_object(path, "model config file")
    if "name" not in d:
        # HF checkpoints keep config.json in a folder named after the model
        d = {**d, "name": path.parent.name if path.name == "config.json" and path.parent.name else path.stem}
    return LlamaConfig.from_dict(d)


def resolve_config(spec: ModelSpec) -> LlamaConfig:
    """Turn a model spec into a ``LlamaConfig`` (a new object; presets are not shared).

    ``spec`` is a preset name (a key of ``PRESETS``), a path to a HuggingFace-style
    ``config.json`` (str ending in .json, an existing file, or a ``PathLike``), a dict
    of HF or ``LlamaConfig`` fields, or a ``LlamaConfig``.
    """
    if isinstance(spec, LlamaConfig):
        return dataclasses.replace(spec)
    if isinstance(spec, dict):
        return LlamaConfig.from_dict(spec)
    if isinstance(spec, os.PathLike):
        return _load_json_config(Path(spec))
    if isinstance(spec, str):
        if spec in PRESETS:
            return dataclasses.replace(PRESETS[spec])
        if spec.endswith(".json") or os.path.isfile(spec):
            return _load_json_config(Path(spec))
        raise ValueError(
            f"unknown model {spec!r}: give one of the presets {', '.join(sorted(PRESETS))}, "
            f"or a path to a HuggingFace config.json")
    raise TypeError(
        f"model spec must be a preset name, a config.json path, a dict or a LlamaConfig, "
        f"got {type(spec).__name__}")


def unit_values(config: dict, parameters: int, num_layers: int) -> tuple[int, int]:
    """(one decoder layer's parameters, the rest's: embeddings, final norm and LM head, FSDP2's root unit) of the
    model `config` (a config dict `resolve_config` takes): a layer is the model of two layers less the model of one;
    the rest is `parameters` less `num_layers` layers (0 parameters: the one-layer model less its layer). Raises what
    `resolve_config` raises for a config it cannot read (ValueError, TypeError, NotImplementedError)."""
    cfg = resolve_config(dict(config))
    one = dataclasses.replace(cfg, num_hidden_layers=1).num_parameters()
    layer = dataclasses.replace(cfg, num_hidden_layers=2).num_parameters() - one
    return layer, (int(parameters) - num_layers * layer if parameters else one - layer)
