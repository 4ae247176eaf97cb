"""Quantization error of the kept tensors against an independent float64 computation on tensors
captured from the unmodified model with module hooks."""

import random

import torch

from agoq.models import build
from agoq.models.llama import apply_rotary
from agoq.profiler.model_source import token_batches
from agoq.profiler.options import Option
from agoq.profiler.tensor_error import measure_tensor_errors
from agoq.runtime.quant.codebook import nf4_levels


def _fake_quant64(x: torch.Tensor, bits: int, fmt: str, block: int) -> torch.Tensor:
    """Block absmax quantization in float64, written from the format's definition."""
    flat = x.double().reshape(-1)
    pad = (-flat.numel()) % block
    xb = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    absmax = xb.abs().amax(dim=1, keepdim=True)
    if fmt == "nf4":
        levels = nf4_levels().double()
        v = torch.where(absmax > 0, xb / absmax, torch.zeros_like(xb))
        nearest = (v[..., None] - levels).abs().argmin(dim=-1)
        out = levels[nearest] * absmax
    else:
        qmax = 2 ** (bits - 1) - 1
        scale = absmax / qmax
        v = torch.where(scale > 0, xb / scale, torch.zeros_like(xb))
        out = torch.floor(v + 0.5).clamp(-qmax, qmax) * scale
    return out.reshape(-1)[: flat.numel()]


def _capture(model, ids):
    """(layer, kind) -> tensors, from hooks on the unmodified model's submodules."""
    found = {}
    hooks = []

    def add(i, kind, t):
        found.setdefault((i, kind), []).append(t.detach().clone())

    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        hooks += [
            layer.input_layernorm.register_forward_pre_hook(lambda mod, x, i=i: add(i, "norm_input", x[0])),
            layer.post_attention_layernorm.register_forward_pre_hook(lambda mod, x, i=i: add(i, "norm_input", x[0])),
            a.q_proj.register_forward_pre_hook(lambda mod, x, i=i: add(i, "qkv_input", x[0])),
            a.o_proj.register_forward_pre_hook(lambda mod, x, i=i: add(i, "o_proj_input", x[0])),
            m.gate_proj.register_forward_pre_hook(lambda mod, x, i=i: add(i, "ffn1_input", x[0])),
            m.gate_proj.register_forward_hook(lambda mod, x, y, i=i: add(i, "silu_input", y)),
            m.up_proj.register_forward_hook(lambda mod, x, y, i=i: add(i, "silu_input", y)),
            m.down_proj.register_forward_pre_hook(lambda mod, x, i=i: add(i, "ffn2_input", x[0])),
        ]

        def attention(mod, args, i=i):
            x, cos, sin = args
            B, S, _ = x.shape
            D = mod.head_dim
            q = mod.q_proj(x).view(B, S, -1, D).transpose(1, 2)
            k = mod.k_proj(x).view(B, S, -1, D).transpose(1, 2)
            v = mod.v_proj(x).view(B, S, -1, D).transpose(1, 2)
            q, k = apply_rotary(q, k, cos, sin)
            # quantized in memory order: the projections' [B, S, heads, D] (q, k and v are transposed
            # views, and RoPE's elementwise result keeps its input's layout)
            for t in (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)):
                add(i, "attention", t.contiguous())

        hooks.append(a.register_forward_pre_hook(attention))
    with torch.no_grad():
        model(ids[:, :-1])
    for h in hooks:
        h.remove()
    return found


KINDS_MEASURED = ("norm_input", "qkv_input", "attention", "o_proj_input", "ffn1_input", "silu_input", "ffn2_input")


def test_errors_match_float64_reference():
    seq = random.randint(17, 40)
    model = build("llama-tiny", dtype=torch.float32, seed=random.randint(0, 1000))
    batches = token_batches(256, 2, 2, seq, random.randint(0, 1000), "cpu")
    options = [Option("3", 3, "int"), Option("4", 4, "nf4"), Option("8", 8, "int")]
    got = measure_tensor_errors(model, batches, {k: options for k in KINDS_MEASURED}, block=64)
    sums = {}
    for ids in batches:
        for key, tensors in _capture(model, ids).items():
            for t in tensors:
                for o in options:
                    e = (_fake_quant64(t, o.bits, o.format, 64) - t.double().reshape(-1)).pow(2).sum().item()
                    acc = sums.setdefault((*key, o.option, o.format), [0.0, 0.0])
                    acc[0] += e
                    acc[1] += t.double().pow(2).sum().item()
    assert set(sums) == set(got)
    assert {(layer, kind) for layer, kind, _, _ in got} == \
        {(layer, kind) for layer in range(model.config.num_hidden_layers) for kind in KINDS_MEASURED}
    for key, (e, n) in sums.items():
        assert abs(got[key] - (e / n) ** 0.5) <= 2e-3 * (e / n) ** 0.5, key
    # ordering by bits for every layer and kind
    for (layer, kind, option, fmt), value in got.items():
        if option == "3":
            assert value > got[(layer, kind, "4", "nf4")] > got[(layer, kind, "8", "int")]
