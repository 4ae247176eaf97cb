"""A reference LLaMA in plain PyTorch.

Short and readable on purpose. The module tree and parameter names mirror
HuggingFace ``transformers.LlamaForCausalLM``, so a state dict from one loads
into the other (``model.layers.3.self_attn.q_proj.weight`` and so on). There is
no KV cache, no padding mask and no dropout: this model exists to be trained
and profiled, one full causal sequence at a time.

The same model serves the config.json families that are LLaMA with small changes: Qwen2
(q/k/v biases) and Mistral (whose sliding window is accepted only where it masks nothing),
and the RoPE scalings of ``agoq.models.rope`` (linear, dynamic, llama3, yarn, longrope).

Shapes used in comments: B batch, S sequence length, H attention heads,
Hkv key/value heads, D head dim, C hidden size, V vocabulary size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agoq.models.lm_loss import chunked_lm_loss
from agoq.models.rope import (
    attention_factor,
    check_rope_scaling_fits,
    normalize_rope_scaling,
    scaled_inv_freq,
)

# ---------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------


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

# ---------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 (HF formula)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Computes RoPE cos/sin tables; no parameters and no state.

    ``inv_freq`` is recomputed on each call (head_dim/2 numbers) rather than kept in a
    buffer, so that ``model.to(bfloat16)`` or building on the meta device cannot touch it.
    ``scaling`` is a normalised rope scaling dict (``agoq.models.rope``) or None for plain RoPE;
    ``max_position_embeddings`` is needed by the types that derive a factor from it.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.max_position_embeddings = max_position_embeddings
        if scaling and max_position_embeddings is None:
            raise ValueError(f"rope_type {scaling['rope_type']!r} needs max_position_embeddings")
        self.attention_factor = attention_factor(scaling, max_position_embeddings or 0)

    def inv_freq(self, device: torch.device | str | None = None,
                 seq_len: torch.Tensor | int | None = None) -> torch.Tensor:
        """Float32 [D/2] angular frequencies in radians per position: 1 / theta**(2i/D) for plain RoPE,
        changed by the rope scaling if any (``seq_len``, the largest position + 1, matters to "dynamic" and
        "longrope" only)."""
        if not self.scaling:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
            return 1.0 / (self.theta ** exponent)
        return scaled_inv_freq(self.head_dim, self.theta, self.scaling, self.max_position_embeddings,
                               seq_len=seq_len, device=device)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (cos, sin), each [P, S, D] in x.dtype, for position_ids of shape [P, S]."""
        # elementwise ops only, so autocast leaves this in float32
        seq_len = None
        if self.scaling and self.scaling["rope_type"] in ("dynamic", "longrope"):
            seq_len = position_ids.max() + 1  # a 0-d tensor: no host sync
        inv_freq = self.inv_freq(x.device, seq_len)
        freqs = position_ids[:, :, None].float() * inv_freq[None, None, :]  # [P, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, S, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dim in halves (x1, x2) and return cat(-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, H, S, D] and k [B, Hkv, S, D] by cos/sin of shape [B or 1, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    """Causal multi-head attention with grouped key/value heads and RoPE."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        C, D, bias = config.hidden_size, config.head_dim, config.qkv_bias
        self.q_proj = nn.Linear(C, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(C, self.num_key_value_heads * D, bias=bias)
        self.v_proj = nn.Linear(C, self.num_key_value_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, C, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, S, self.num_heads, D).transpose(1, 2)  # [B, H, S, D]
        k = self.k_proj(x).view(B, S, self.num_key_value_heads, D).transpose(1, 2)  # [B, Hkv, S, D]
        v = self.v_proj(x).view(B, S, self.num_key_value_heads, D).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if self.num_key_value_heads < self.num_heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, S, self.num_heads * D)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, I, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(C, I, bias=bias)
        self.up_proj = nn.Linear(C, I, bias=bias)
        self.down_proj = nn.Linear(I, C, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm; returns hidden states [B, S, C]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # one row of positions, broadcast over the batch: cos/sin are [1, S, D]
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """LLaMA language model: ``forward(ids)`` gives logits, ``forward(ids, labels)`` the loss."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V] if labels is None, else the scalar float32 mean cross-entropy, computed by the
        chunked head (agoq.models.lm_loss: the full float32 logits never exist at once).

        ``labels`` [B, S] must already be shifted (labels[:, t] is the target for position t);
        positions labelled -100 are ignored.
        """
        hidden = self.model(input_ids)
        if labels is None:
            return self.lm_head(hidden)
        return chunked_lm_loss(hidden, self.lm_head.weight, labels)

    def num_parameters(self) -> int:
        """Number of distinct parameter elements (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())


__all__ = [
    "LlamaConfig", "PRESETS", "RMSNorm", "RotaryEmbedding", "rotate_half", "apply_rotary",
    "LlamaAttention", "LlamaMLP", "LlamaDecoderLayer", "LlamaModel", "LlamaForCausalLM",
]
