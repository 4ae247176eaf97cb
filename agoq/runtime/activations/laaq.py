"""LAAQ: layer-aware activation quantization of LLaMA-style decoder layers.

`apply_activation_policy(model, policy)` replaces the forward of each decoder layer whose settings are
not all 16 bits by one built from four autograd functions that decide exactly what is kept for
backward: each tensor kind is stored at its bit width (a packed QTensor), kept, or rebuilt in backward
from a stored tensor ("recompute"). Layers whose settings are all 16 run their own forward untouched,
so the `bf16` policy changes nothing. The change is undone by `remove_activation_policy(model)`.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agoq.runtime.activations.policy import KEEP, RECOMPUTE, ActivationPolicy, as_policy
from agoq.runtime.activations.rmsnorm import rms_norm, rms_norm_backward
from agoq.runtime.activations.saved_bytes import find_decoder_layers, label, scope
from agoq.runtime.activations.swiglu import swiglu, swiglu_backward
from agoq.runtime.quant.qtensor import QTensor
from agoq.runtime.quant.codec import dequantize, quantize_unchecked


@dataclass(frozen=True)
class QuantConfig:
    """How quantized kinds are stored: block size, format and rounding of every QTensor."""

    block: int = 128
    format: str = "int"
    rounding: str = "nearest"


_observers: list = []  # callbacks of `observe_kept_tensors`, innermost last


@contextlib.contextmanager
def observe_kept_tensors(callback):
    """While inside, call `callback(kind, tensor, setting)` for every tensor a LAAQ layer is about to keep
    for backward, before it is quantized (setting: bits, 16 or "recompute"). For measuring, not training."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


_rerun_attention: list = []  # one entry per open `rerun_kept_attention`


@contextlib.contextmanager
def rerun_kept_attention():
    """While inside, a LAAQ layer whose attention is kept at 16 bits stores q, k, v raw through
    `_QuantizedAttention` (backward reruns attention from them: the values of the fused attention's own
    backward) instead of calling the fused attention directly, so the observers see q, k and v. It uses
    more time in backward. For measuring, not training (agoq.profiler.replay)."""
    _rerun_attention.append(True)
    try:
        yield
    finally:
        _rerun_attention.pop()


class _Stash:
    """Collects tensors to save for backward, each kept raw or as a QTensor, and restores them."""

    def __init__(self, cfg: QuantConfig):
        self.cfg, self.tensors, self.meta = cfg, [], []

    def add(self, t: torch.Tensor | None, setting, kind: str) -> None:
        if t is not None:
            for observe in _observers:
                observe(kind, t, setting)
        if t is None or setting == RECOMPUTE:
            self.meta.append(None)
            return
        if setting == KEEP:
            label(t, kind)
            self.tensors.append(t)
            self.meta.append("raw")
            return
        fmt = self.cfg.format if setting == 4 else "int"
        q = quantize_unchecked(t, setting, self.cfg.block, self.cfg.rounding, fmt, check_finite=False)  # policy-checked
        label(q.data, kind)
        label(q.scales, kind)
        self.tensors += [q.data, q.scales]
        self.meta.append(q)

    def save(self, ctx) -> None:
        ctx.save_for_backward(*self.tensors)
        ctx.stash_meta = [m if m in (None, "raw") else QTensor(None, None, m.shape, m.dtype, m.bits, m.block,
                                                                 m.format, m.order) for m in self.meta]

    @staticmethod
    def restore(ctx) -> list[torch.Tensor | None]:
        saved, out, i = list(ctx.saved_tensors), [], 0
        for m in ctx.stash_meta:
            if m is None:
                out.append(None)
            elif m == "raw":
                out.append(saved[i])
                i += 1
            else:
                q = QTensor(saved[i], saved[i + 1], m.shape, m.dtype, m.bits, m.block, m.format, m.order)
                out.append(dequantize(q))
                i += 2
        return out


def _linear_grads(dy: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor, has_bias: bool, needs):
    """(grad input, grad weight, grad bias) of y = inp @ weight.T + bias; None where not needed."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    gi = (dy2 @ weight).view(*dy.shape[:-1], weight.shape[1]) if needs[0] else None
    gw = dy2.t() @ inp.reshape(-1, inp.shape[-1]) if needs[1] else None
    gb = dy2.sum(0) if has_bias and needs[2] else None
    return gi, gw, gb


class _NormLinears(torch.autograd.Function):
    """RMSNorm followed by several projections of its output (QKV, or gate and up).

    Keeps the norm input under `norm_setting`, the norm output under `out_setting` (or rebuilds it
    from the stored norm input when that is "recompute").
    """

    @staticmethod
    def forward(ctx, x, norm_weight, eps, cfg, norm_setting, out_setting, out_kind, *weights_biases):
        h = rms_norm(x, norm_weight, eps)
        ys = [F.linear(h, weights_biases[i], weights_biases[i + 1]) for i in range(0, len(weights_biases), 2)]
        stash = _Stash(cfg)
        stash.add(x, norm_setting, "norm_input")
        stash.add(h, out_setting, out_kind)
        stash.save(ctx)
        ctx.weights_biases, ctx.norm_weight, ctx.eps = weights_biases, norm_weight, eps
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, h = _Stash.restore(ctx)
        wb, w = ctx.weights_biases, ctx.norm_weight
        grad_h = None
        for j, dy in enumerate(dys):
            gi = (dy.reshape(-1, dy.shape[-1]) @ wb[2 * j]).view(*dy.shape[:-1], -1)
            grad_h = gi if grad_h is None else grad_h.add_(gi)
        dx, dw, rebuilt = rms_norm_backward(x, w, ctx.eps, grad_h, want_output=h is None)
        h = rebuilt if h is None else h
        param_grads = []
        for j, dy in enumerate(dys):
            weight, bias = wb[2 * j], wb[2 * j + 1]
            needs = (False, ctx.needs_input_grad[7 + 2 * j], bias is not None and ctx.needs_input_grad[8 + 2 * j])
            _, gw, gb = _linear_grads(dy, h, weight, bias is not None, needs)
            param_grads += [gw, gb]
        return (dx, dw if ctx.needs_input_grad[1] else None, None, None, None, None, None, *param_grads)


class _StoredLinear(torch.autograd.Function):
    """A projection whose input is kept under `setting` (the output projection of attention)."""

    @staticmethod
    def forward(ctx, x, weight, bias, cfg, setting, kind):
        stash = _Stash(cfg)
        stash.add(x, setting, kind)
        stash.save(ctx)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = _Stash.restore(ctx)
        gi, gw, gb = _linear_grads(dy, x, ctx.weight, ctx.has_bias, ctx.needs_input_grad[:3])
        return gi, gw, gb, None, None, None


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) * up): keeps gate and up under `silu_setting`, the product under `out_setting`."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, cfg, silu_setting, out_setting):
        a = swiglu(gate, up)
        stash = _Stash(cfg)
        stash.add(gate, silu_setting, "silu_input")
        stash.add(up, silu_setting, "silu_input")
        stash.add(a, out_setting, "ffn2_input")
        stash.save(ctx)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return F.linear(a, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        gate, up, a = _Stash.restore(ctx)
        dy2 = dy.reshape(-1, dy.shape[-1])
        da = (dy2 @ ctx.weight).view(*dy.shape[:-1], -1)
        d_gate, d_up, rebuilt = swiglu_backward(gate, up, da, want_output=a is None)
        a = rebuilt if a is None else a
        _, gw, gb = _linear_grads(dy, a, ctx.weight, ctx.has_bias, (False, *ctx.needs_input_grad[2:4]))
        return d_gate, d_up, gw, gb, None, None, None


class _QuantizedAttention(torch.autograd.Function):
    """Scaled dot-product attention keeping q, k, v at `setting` bits; backward reruns the forward."""

    @staticmethod
    def forward(ctx, q, k, v, cfg, setting, sdpa_kwargs):
        out = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
        stash = _Stash(cfg)
        for t in (q, k, v):
            stash.add(t, setting, "attention")
        stash.save(ctx)
        ctx.sdpa_kwargs = sdpa_kwargs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = _Stash.restore(ctx)
        _, vjp = torch.func.vjp(functools.partial(F.scaled_dot_product_attention, **ctx.sdpa_kwargs), q, k, v)
        dq, dk, dv = vjp(dout)
        return dq, dk, dv, None, None, None


# ----------------------------------------------------------------------------------------------
# the decoder layer, read through an adapter so HuggingFace layers and agoq's own look the same


@dataclass
class _LayerParts:
    attn_norm: nn.Module
    mlp_norm: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _norm_eps(norm: nn.Module) -> float:
    for name in ("eps", "variance_epsilon"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise TypeError(f"cannot find the epsilon of norm module {type(norm).__name__}")


SUPPORTED = ("agoq LlamaForCausalLM", "transformers LlamaForCausalLM", "transformers MistralForCausalLM",
             "transformers Qwen2ForCausalLM")


def _is_silu(act) -> bool:
    """Whether an activation computes SiLU, judged by what it returns (implementations differ by library)."""
    probe = torch.linspace(-6.0, 6.0, 25, dtype=torch.float64)
    try:
        with torch.no_grad():
            return bool(torch.allclose(act(probe), F.silu(probe), rtol=1e-6, atol=1e-9))
    except Exception:  # an activation that cannot take a CPU float64 tensor is not one we know
        return False


def _layer_parts(layer: nn.Module) -> _LayerParts:
    attn, mlp = layer.self_attn, layer.mlp
    needed = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    for owner, names in needed.items():
        module = getattr(layer, owner)
        missing = [n for n in names if not isinstance(getattr(module, n, None), nn.Linear)]
        if missing:
            raise NotImplementedError(f"{type(layer).__name__}.{owner} has no nn.Linear {missing}: not a LLaMA-style "
                                      f"layer; supported models: {', '.join(SUPPORTED)}")
    act = getattr(mlp, "act_fn", None)
    if act is not None and not _is_silu(act):
        raise NotImplementedError(f"{type(mlp).__name__} uses activation {type(act).__name__}; LAAQ supports SwiGLU "
                                  "(SiLU) MLPs only")
    head_dim = int(attn.head_dim)
    num_heads = getattr(attn, "num_heads", None) or attn.q_proj.out_features // head_dim
    num_kv = getattr(attn, "num_key_value_heads", None) or attn.k_proj.out_features // head_dim
    return _LayerParts(layer.input_layernorm, layer.post_attention_layernorm, attn.q_proj, attn.k_proj,
                       attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                       int(num_heads), int(num_kv), head_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def laaq_layer_forward(parts: _LayerParts, settings: dict, cfg: QuantConfig, x: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None,
                       on_key_value=None) -> torch.Tensor:
    """One LLaMA decoder layer, keeping each tensor kind for backward as `settings` says.

    `on_key_value(k, v)`, if given, receives the rotated keys and the values (to fill a KV cache).
    """
    B, S, _ = x.shape
    H, Hkv, D = parts.num_heads, parts.num_kv_heads, parts.head_dim
    n1 = parts.attn_norm
    q, k, v = _NormLinears.apply(
        x, n1.weight, _norm_eps(n1), cfg, settings["norm_input"], settings["qkv_input"], "qkv_input",
        parts.q.weight, parts.q.bias, parts.k.weight, parts.k.bias, parts.v.weight, parts.v.bias)
    q = q.view(B, S, H, D).transpose(1, 2)
    k = k.view(B, S, Hkv, D).transpose(1, 2)
    v = v.view(B, S, Hkv, D).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    if on_key_value is not None:
        on_key_value(k.detach(), v.detach())
    sdpa_kwargs = {"is_causal": True} if attn_mask is None else {"attn_mask": attn_mask}
    if Hkv != H:
        sdpa_kwargs["enable_gqa"] = True
    if settings["attention"] == KEEP and not _rerun_attention:
        with scope("attention"):
            y = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
    else:
        y = _QuantizedAttention.apply(q, k, v, cfg, settings["attention"], sdpa_kwargs)
    y = y.transpose(1, 2).reshape(B, S, H * D)
    x = x + _StoredLinear.apply(y, parts.o.weight, parts.o.bias, cfg, settings["o_proj_input"], "o_proj_input")
    n2 = parts.mlp_norm
    gate, up = _NormLinears.apply(
        x, n2.weight, _norm_eps(n2), cfg, settings["norm_input"], settings["ffn1_input"], "ffn1_input",
        parts.gate.weight, parts.gate.bias, parts.up.weight, parts.up.bias)
    out = _SwiGLUDown.apply(gate, up, parts.down.weight, parts.down.bias, cfg, settings["silu_input"],
                            settings["ffn2_input"])
    return x + out


# ----------------------------------------------------------------------------------------------
# installing and removing


def _is_hf_layer(layer: nn.Module) -> bool:
    return type(layer).__module__.startswith("transformers.")


def _make_forward(layer: nn.Module, parts: _LayerParts, settings: dict, cfg: QuantConfig):
    original = type(layer).forward
    if _is_hf_layer(layer):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False, position_embeddings=None, **kwargs):
            layer_idx = getattr(self.self_attn, "layer_idx", 0)
            decoding = past_key_values is not None and past_key_values.get_seq_length(layer_idx) > 0
            if not torch.is_grad_enabled() or decoding or position_embeddings is None:
                return original(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                past_key_values=past_key_values, use_cache=use_cache,
                                position_embeddings=position_embeddings, **kwargs)
            on_kv = None
            if past_key_values is not None:  # HF fills a cache in training too when config.use_cache is on
                on_kv = lambda k, v: past_key_values.update(k, v, layer_idx)  # noqa: E731
            cos, sin = position_embeddings
            return laaq_layer_forward(parts, settings, cfg, hidden_states, cos, sin, attention_mask, on_kv)
    else:
        def forward(self, x, cos, sin):
            if not torch.is_grad_enabled():
                return original(self, x, cos, sin)
            return laaq_layer_forward(parts, settings, cfg, x, cos, sin)
    return types.MethodType(forward, layer)


def remove_activation_policy(model: nn.Module) -> int:
    """Undo `apply_activation_policy`: every decoder layer runs its own forward again; returns how many changed."""
    count = 0
    for layer in find_decoder_layers(model):
        if "forward" in layer.__dict__ and getattr(layer, "_agoq_settings", None) is not None:
            del layer.forward
            count += 1
        layer._agoq_settings = None
    model._agoq_policy = None
    return count


def apply_activation_policy(model: nn.Module, policy: ActivationPolicy | str | dict) -> ActivationPolicy:
    """Make `model` keep activations for backward as `policy` says (a policy, preset name or dict).

    Replaces any policy applied before. Raises NotImplementedError for models without LLaMA-style
    decoder layers and ValueError when the policy names layers the model does not have.
    """
    policy = as_policy(policy)
    layers = find_decoder_layers(model)
    if not layers:
        kinds = sorted({type(m).__name__ for m in model.children()})
        raise NotImplementedError(
            f"{type(model).__name__} has no LLaMA-style decoder layers (modules with self_attn, mlp, "
            f"input_layernorm and post_attention_layernorm); its children are {kinds}. "
            f"Supported models: {', '.join(SUPPORTED)}")
    extra = [i for i in policy.layers if i >= len(layers)]
    if extra:
        raise ValueError(f"policy {policy.name!r} sets layer(s) {extra} but the model has {len(layers)} layers "
                         f"(0..{len(layers) - 1})")
    parts = [_layer_parts(layer) for layer in layers]  # validate every layer before changing any
    remove_activation_policy(model)
    cfg = QuantConfig(policy.block, policy.format, policy.rounding)
    for index, (layer, p) in enumerate(zip(layers, parts)):
        if policy.keeps_everything(index):
            continue
        settings = policy.settings(index)
        layer.forward = _make_forward(layer, p, settings, cfg)
        layer._agoq_settings = settings
    model._agoq_policy = policy
    return policy
