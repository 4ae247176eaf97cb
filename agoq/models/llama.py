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

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agoq.models.config import PRESETS, LlamaConfig
from agoq.models.lm_loss import chunked_lm_loss
from agoq.models.rope import scaled_inv_freq
from agoq.models.rope_scaling import attention_factor


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
