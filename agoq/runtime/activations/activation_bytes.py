"""Predict the bytes a decoder layer keeps for backward, per tensor kind, from shapes and settings.

The counts follow what the layer's code saves: LAAQ's own functions for layers under a policy, and
the unmodified LLaMA forward (float32 RMSNorm statistics, SiLU and the product kept separately)
for layers left at 16 bits. `track_saved_tensors` measures the same quantities on a real pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from agoq.runtime.activations.policy import KEEP, RECOMPUTE, Setting
from agoq.runtime.quant.layout import quantized_nbytes


@dataclass(frozen=True)
class LayerShape:
    """The sizes of one decoder layer's activations for a micro-batch of `batch` x `seq` tokens."""

    batch: int
    seq: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int = 2  # bytes per value of the model's dtype

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @classmethod
    def from_config(cls, config, batch: int, seq: int, elem_bytes: int = 2) -> "LayerShape":
        """From a LlamaConfig-like object (hidden_size, intermediate_size, heads, head_dim)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return cls(batch, seq, config.hidden_size, config.intermediate_size, heads, kv, head_dim, elem_bytes)


def tensor_bytes(numel: int, setting: Setting, elem_bytes: int, block: int) -> int:
    """Bytes kept for a tensor of `numel` values under one setting (16: raw, bits: packed + scales)."""
    if setting == RECOMPUTE:
        return 0
    if setting == KEEP:
        return numel * elem_bytes
    return quantized_nbytes(numel, int(setting), block)


def _sdpa_bytes(s: LayerShape) -> int:
    """What torch's fused attention keeps: q, k, v, the output and a float32 logsumexp per row."""
    e, t = s.elem_bytes, s.tokens
    return e * t * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads) + 4 * s.batch * s.num_heads * s.seq


def predict_layer_bytes(s: LayerShape, settings: dict[str, Setting] | None, block: int = 128) -> dict[str, int]:
    """Bytes kept for backward per kind by one layer; `settings` None means the unmodified layer."""
    e, t = s.elem_bytes, s.tokens
    C, I, HD, KD = s.hidden, s.intermediate, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    if settings is None or all(v == KEEP for v in settings.values()):
        # per RMSNorm: a float32 copy of the input, float32 1/rms per token, the normalised tensor
        return {"norm": 2 * (4 * t * C + 4 * t + e * t * C), "qkv_input": e * t * C,
                "attention": _sdpa_bytes(s), "o_proj_input": 0,  # a view of the attention output
                "ffn1_input": e * t * C, "silu_mul": 3 * e * t * I, "ffn2_input": e * t * I}

    def b(numel: int, kind: str) -> int:
        return tensor_bytes(numel, settings[kind], e, block)

    attention = _sdpa_bytes(s) if settings["attention"] == KEEP else b(t * HD, "attention") + 2 * b(t * KD, "attention")
    shares_attention_output = settings["attention"] == KEEP and settings["o_proj_input"] == KEEP
    return {
        "norm_input": 2 * b(t * C, "norm_input"),
        "qkv_input": b(t * C, "qkv_input"),
        "attention": attention,
        "o_proj_input": 0 if shares_attention_output else b(t * HD, "o_proj_input"),
        "ffn1_input": b(t * C, "ffn1_input"),
        "silu_input": 2 * b(t * I, "silu_input"),
        "ffn2_input": b(t * I, "ffn2_input"),
    }
