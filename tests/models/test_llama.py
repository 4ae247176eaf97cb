"""Tests for the reference LLaMA (agoq.models): numerics against float64 references,
parity with HuggingFace transformers, config parsing and ``build``."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math

import pytest
import torch

from agoq.models import PRESETS, LlamaConfig, LlamaForCausalLM, build, resolve_config
from agoq.models.llama import LlamaAttention, RMSNorm, RotaryEmbedding, apply_rotary


def _rope_tables_f64(positions: torch.Tensor, head_dim: int, theta: float):
    """Closed-form cos/sin [1, S, D] in float64: angle(p, i) = p * theta**(-2i/D), halves repeated."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    ang = positions.double()[:, None] * theta ** (-2.0 * i / head_dim)[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos()[None], ang.sin()[None]


def _rotate_pairs_f64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + D/2) pair of x [B, H, S, D] by the angle whose cos/sin are given."""
    h = x.shape[-1] // 2
    c, s = cos[:, None, :, :h], sin[:, None, :, :h]
    a, b = x[..., :h], x[..., h:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


# ---------------------------------------------------------------------------
# 1. RMSNorm
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_rmsnorm_matches_float64_closed_form(dtype, atol, seed):
    g = torch.Generator().manual_seed(seed)
    dim, eps = 37, 1e-5
    x = (torch.randn(3, 5, dim, generator=g, dtype=torch.float64) * 3 + 0.5)
    w = torch.randn(dim, generator=g, dtype=torch.float64)
    norm = RMSNorm(dim, eps=eps)
    assert norm.eps == eps
    with torch.no_grad():
        norm.weight.copy_(w)
    norm = norm.to(dtype)
    out = norm(x.to(dtype))
    ref = w * x / torch.sqrt((x * x).sum(-1, keepdim=True) / dim + eps)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


# ---------------------------------------------------------------------------
# 2. RoPE
# ---------------------------------------------------------------------------

def test_rotary_tables_match_closed_form():
    D, theta, S = 22, 500000.0, 41
    rope = RotaryEmbedding(D, theta)
    pos = torch.arange(S).unsqueeze(0)
    x = torch.empty(1, S, 8, dtype=torch.float32)
    cos, sin = rope(x, pos)
    assert cos.shape == (1, S, D) and cos.dtype == torch.float32
    ref_cos, ref_sin = _rope_tables_f64(torch.arange(S), D, theta)
    torch.testing.assert_close(cos.double(), ref_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin.double(), ref_sin, atol=1e-5, rtol=0)
    # batch of different position rows; tables come back in the dtype of x
    pos2 = torch.stack([torch.arange(S), torch.arange(S) + 7])
    cos2, sin2 = rope(x.bfloat16(), pos2)
    assert cos2.shape == (2, S, D) and cos2.dtype == torch.bfloat16
    torch.testing.assert_close(cos2[1].double(), _rope_tables_f64(torch.arange(S) + 7, D, theta)[0][0],
                               atol=1e-2, rtol=0)


def test_rope_preserves_pair_norms_and_depends_on_relative_position(seed):
    D, theta = 18, 10000.0
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 3, 1, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, 3, 1, D, generator=g, dtype=torch.float64)

    def rope_at(x, p):
        cos, sin = _rope_tables_f64(torch.tensor([p]), D, theta)
        out, _ = apply_rotary(x, x, cos, sin)
        return out

    h = D // 2
    for p in (0, 5, 123):
        r = rope_at(q, p)
        pair_in = q[..., :h] ** 2 + q[..., h:] ** 2
        pair_out = r[..., :h] ** 2 + r[..., h:] ** 2
        torch.testing.assert_close(pair_out, pair_in, atol=1e-12, rtol=1e-12)

    def score(m, n):
        return (rope_at(q, m) * rope_at(k, n)).sum(-1)

    for delta in (3, -11):
        base = score(20 + delta, 20)
        for shift in (-20, 1, 57):
            torch.testing.assert_close(score(20 + delta + shift, 20 + shift), base, atol=1e-10, rtol=1e-10)
    # and it is not position independent: different offsets give different scores
    assert (score(23, 20) - score(9, 20)).abs().max() > 1e-3
    # apply_rotary rotates k too, identically
    cos, sin = _rope_tables_f64(torch.tensor([9]), D, theta)
    rq, rk = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(rk, _rotate_pairs_f64(k, cos, sin), atol=1e-12, rtol=0)
    torch.testing.assert_close(rq, _rotate_pairs_f64(q, cos, sin), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------
# 3. attention
# ---------------------------------------------------------------------------

def _attention_f64(attn: LlamaAttention, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Brute-force causal GQA attention: explicit masked softmax, kv heads repeated."""
    B, S, _ = x.shape
    H, Hkv, D = attn.num_heads, attn.num_key_value_heads, attn.head_dim

    def lin(m, t):
        y = t @ m.weight.double().T
        return y + m.bias.double() if m.bias is not None else y

    q = lin(attn.q_proj, x).view(B, S, H, D).permute(0, 2, 1, 3)
    k = lin(attn.k_proj, x).view(B, S, Hkv, D).permute(0, 2, 1, 3)
    v = lin(attn.v_proj, x).view(B, S, Hkv, D).permute(0, 2, 1, 3)
    q, k = _rotate_pairs_f64(q, cos, sin), _rotate_pairs_f64(k, cos, sin)
    group = H // Hkv
    out = torch.empty(B, H, S, D, dtype=torch.float64)
    for h in range(H):
        kh, vh = k[:, h // group], v[:, h // group]
        s = q[:, h] @ kh.transpose(-1, -2) / math.sqrt(D)
        mask = torch.ones(S, S, dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
        e = (s - s.amax(-1, keepdim=True)).exp()
        p = e / e.sum(-1, keepdim=True)
        out[:, h] = p @ vh
    y = out.permute(0, 2, 1, 3).reshape(B, S, H * D)
    return lin(attn.o_proj, y)


@pytest.mark.parametrize("heads,kv_heads,head_dim,bias", [(6, 2, 10, True), (3, 3, 14, False), (4, 1, 8, False)])
def test_attention_matches_bruteforce_float64(heads, kv_heads, head_dim, bias):
    cfg = LlamaConfig(vocab_size=11, hidden_size=30, intermediate_size=7, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      attention_bias=bias)
    attn = LlamaAttention(cfg)  # initialised from torch's generator, seeded per test
    with torch.no_grad():  # weights large enough that softmax is far from uniform
        for p in attn.parameters():
            p.normal_(0, 0.5)
    B, S = 2, 13
    x = torch.randn(B, S, cfg.hidden_size, dtype=torch.float64)
    cos, sin = _rope_tables_f64(torch.arange(S), head_dim, cfg.rope_theta)
    ref = _attention_f64(attn, x, cos, sin)
    out = attn.double()(x, cos, sin)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    # float32 path with the module's own rotary tables
    cos32, sin32 = RotaryEmbedding(head_dim, cfg.rope_theta)(x.float(), torch.arange(S)[None])
    out32 = attn.float()(x.float(), cos32, sin32)
    torch.testing.assert_close(out32.double(), ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------
# 4. full tiny model
# ---------------------------------------------------------------------------

def test_tiny_model_logits_loss_and_causality(seed):
    model = build("llama-tiny", seed=seed)
    cfg = model.config
    B, S, V = 2, 37, cfg.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = -100
    labels[1, -3:] = -100

    logits = model(ids)
    assert logits.shape == (B, S, V) and logits.dtype == torch.float32
    loss = model(ids, labels)
    assert loss.ndim == 0 and loss.dtype == torch.float32
    logp = torch.log_softmax(logits.double(), dim=-1)
    keep = labels != -100
    manual = -logp[keep].gather(-1, labels[keep][:, None]).mean()
    torch.testing.assert_close(loss.double(), manual, atol=1e-6, rtol=1e-6)
    # an untrained model with std 0.02 init is close to uniform
    assert abs(loss.item() - math.log(V)) < 0.1

    for t in (1, 17, S - 1):
        ids2 = ids.clone()
        ids2[:, t] = (ids2[:, t] + 1 + torch.arange(B)) % V
        logits2 = model(ids2)
        torch.testing.assert_close(logits2[:, :t], logits[:, :t], atol=1e-6, rtol=0)
        assert (logits2[:, t:] - logits[:, t:]).abs().amax(dim=-1).min() > 1e-6


def test_tiny_model_backward_reaches_every_parameter():
    model = build("llama-tiny")
    ids = torch.randint(0, 256, (2, 37))
    loss = model(ids, ids.roll(-1, 1))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_init_is_deterministic_and_follows_config(seed):
    a, b, c = build("llama-tiny", seed=seed), build("llama-tiny", seed=seed), build("llama-tiny", seed=seed + 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
    w = torch.cat([p.flatten() for n, p in a.named_parameters() if n.endswith("proj.weight")])
    assert abs(w.std().item() - 0.02) < 1e-3 and abs(w.mean().item()) < 1e-3
    assert a.num_parameters() == a.config.num_parameters()
    # tied embeddings: one tensor, counted once
    tied = build(dataclasses.replace(PRESETS["llama-tiny"], tie_word_embeddings=True, attention_bias=True,
                                     mlp_bias=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.num_parameters() == tied.config.num_parameters()
    assert all(torch.equal(m.bias, torch.zeros_like(m.bias)) for m in tied.modules()
               if isinstance(m, torch.nn.Linear) and m.bias is not None)


def test_layers_are_called_as_layer_x_cos_sin():
    model = build("llama-tiny")
    seen = []

    def hook(module, args, kwargs):
        seen.append((len(args), sorted(kwargs), tuple(a.shape for a in args)))

    for layer in model.model.layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
    model(torch.zeros(2, 9, dtype=torch.long))
    assert seen == [(3, [], ((2, 9, 64), (1, 9, 16), (1, 9, 16)))] * 3


# ---------------------------------------------------------------------------
# 5. parity with HuggingFace transformers
# ---------------------------------------------------------------------------

def _hf_model(cfg: LlamaConfig):
    transformers = pytest.importorskip("transformers")
    d = cfg.to_dict()
    d.pop("name")
    d.pop("model_type")
    rope_theta = d.pop("rope_theta")
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    else:  # transformers 4.x
        d["rope_theta"] = rope_theta
    hf_cfg = transformers.LlamaConfig(**d, attn_implementation="eager")
    return transformers.LlamaForCausalLM(hf_cfg).float().eval()


_PARITY_CONFIGS = {
    "tiny": PRESETS["llama-tiny"],
    "tied-bias-headdim": LlamaConfig(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, head_dim=12,
                                     rope_theta=500000.0, rms_norm_eps=1e-6, attention_bias=True,
                                     mlp_bias=True, tie_word_embeddings=True),
}


@pytest.mark.parametrize("which", sorted(_PARITY_CONFIGS))
def test_state_dict_and_logits_match_huggingface(which, seed):
    cfg = _PARITY_CONFIGS[which]
    ours = build(cfg, seed=seed)
    with torch.no_grad():  # non-trivial norm weights and biases so that every parameter matters
        for n, p in ours.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    hf = _hf_model(cfg)
    sd = ours.state_dict()
    assert set(sd) == set(hf.state_dict()), "parameter names differ from HF"
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)
    assert not missing
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (2, 29), generator=g)
    ref = hf(input_ids=ids).logits
    out = ours(ids)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

    # loss and gradients: HF shifts labels itself, ours takes shifted labels
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    hf_loss = hf(input_ids=ids, labels=ids).loss
    loss = ours(ids, labels)
    torch.testing.assert_close(loss, hf_loss, atol=1e-6, rtol=1e-6)
    hf_loss.backward()
    loss.backward()
    hf_params = dict(hf.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[n].grad, atol=1e-6, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_huggingface_config_dict_round_trips():
    transformers = pytest.importorskip("transformers")
    cfg = _PARITY_CONFIGS["tied-bias-headdim"]
    hf_dict = _hf_model(cfg).config.to_dict()
    back = LlamaConfig.from_dict(json.loads(json.dumps(hf_dict)))
    assert dataclasses.replace(back, name=cfg.name) == cfg
    del transformers


# ---------------------------------------------------------------------------
# 6. config parsing and build
# ---------------------------------------------------------------------------

def test_presets_shapes_and_parameter_counts():
    assert set(PRESETS) >= {"llama-tiny", "probe", "llama-3.2-1b", "llama-3-8b"}
    for name, cfg in PRESETS.items():
        assert cfg.name == name
        assert resolve_config(name) == cfg and resolve_config(name) is not cfg
    c = resolve_config("llama-3-8b")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.vocab_size) == (4096, 14336, 32, 32, 8, 128, 128256)
    assert c.num_parameters() == 8_030_261_248  # published Meta-Llama-3-8B count
    c = resolve_config("llama-3.2-1b")
    assert (c.head_dim, c.num_key_value_heads, c.tie_word_embeddings, c.rope_theta) == (64, 8, True, 500000.0)
    assert c.num_parameters() == 1_235_814_400  # published Llama-3.2-1B count
    c = resolve_config("probe")
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == \
        (2048, 16, 16, 128, 32000)


def test_build_variants(tmp_path):
    m = build("llama-tiny", dtype=torch.bfloat16, seed=3)
    assert isinstance(m, LlamaForCausalLM)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    ref = build("llama-tiny", seed=3)
    assert torch.equal(m.lm_head.weight, ref.lm_head.weight.bfloat16())
    assert m(torch.zeros(1, 5, dtype=torch.long)).dtype == torch.bfloat16

    meta = build("probe", num_layers=1, device="meta")
    assert len(meta.model.layers) == 1 and meta.config.num_hidden_layers == 1
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert meta.model.embed_tokens.weight.shape == (32000, 2048)
    out = meta(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    assert out.shape == (2, 8, 32000)

    hf_style = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
                "bos_token_id": 1, "eos_token_id": [2, 3], "hidden_act": "silu", "use_cache": True,
                "attention_dropout": 0.0, "rope_scaling": None, "pretraining_tp": 1,
                "transformers_version": "4.44.0", "some_future_key": {"x": 1},
                "vocab_size": 300, "hidden_size": 48, "intermediate_size": 100, "num_hidden_layers": 2,
                "num_attention_heads": 6, "num_key_value_heads": 3, "rope_theta": 250000.0}
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_style))
    for spec in (d / "config.json", str(d / "config.json")):
        m = build(spec, num_layers=1)
        assert m.config.name == "my-model"
        assert (m.config.vocab_size, m.config.head_dim, m.config.num_hidden_layers, m.config.rope_theta) == \
            (300, 8, 1, 250000.0)
        assert m.model.layers[0].self_attn.k_proj.weight.shape == (24, 48)

    m = build({"vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
               "num_attention_heads": 2, "name": "from-dict"})
    assert m.config.name == "from-dict" and m.config.num_key_value_heads == 2 and m.config.head_dim == 8
    cfg = resolve_config("llama-tiny")
    assert build(cfg).config == cfg


def test_config_to_dict_round_trip():
    for cfg in list(PRESETS.values()) + list(_PARITY_CONFIGS.values()):
        d = json.loads(json.dumps(cfg.to_dict()))
        assert d["model_type"] == "llama"
        assert LlamaConfig.from_dict(d) == cfg
    # transformers >= 5 style rope_parameters is understood
    d = PRESETS["llama-tiny"].to_dict()
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.5}
    assert LlamaConfig.from_dict(d).rope_theta == 1234.5


def test_build_errors_are_helpful(tmp_path):
    with pytest.raises(ValueError, match="llama-tiny") as e:
        build("llama-7b-typo")
    assert "llama-7b-typo" in str(e.value) and "llama-3-8b" in str(e.value)

    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        build(str(missing))
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_config(missing)

    bad = tmp_path / "broken.json"
    bad.write_text("{ not json")
    with pytest.raises(ValueError, match="broken.json"):
        build(bad)
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json"):
        build(arr)

    with pytest.raises(ValueError, match="gemma") as e:
        build({**PRESETS["llama-tiny"].to_dict(), "model_type": "gemma"})
    assert "LLaMA" in str(e.value) and "'qwen2'" in str(e.value) and "'mistral'" in str(e.value)
    with pytest.raises(ValueError, match="gelu"):
        resolve_config({**PRESETS["llama-tiny"].to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="attention_dropout"):
        resolve_config({**PRESETS["llama-tiny"].to_dict(), "attention_dropout": 0.1})
    with pytest.raises(ValueError, match="rope_scaling.*low_freq_factor"):  # an incomplete llama3 scaling
        resolve_config({**PRESETS["llama-tiny"].to_dict(),
                        "rope_scaling": {"rope_type": "llama3", "factor": 32.0}})
    with pytest.raises(NotImplementedError, match="rope_parameters.*'proportional'"):
        resolve_config({**PRESETS["llama-tiny"].to_dict(),
                        "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        build("llama-tiny", num_layers=0)
    with pytest.raises(TypeError):
        resolve_config(42)


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_attention_heads=12, num_key_value_heads=5, hidden_size=96),
     ["num_attention_heads (12)", "num_key_value_heads (5)"]),
    (dict(hidden_size=100, num_attention_heads=3), ["hidden_size (100)", "num_attention_heads (3)", "head_dim"]),
    (dict(vocab_size=-1), ["vocab_size", "positive integer", "-1"]),
    (dict(num_hidden_layers=2.0), ["num_hidden_layers", "positive integer"]),
    (dict(intermediate_size=True), ["intermediate_size"]),
    (dict(head_dim=7), ["head_dim (7)", "even"]),
    (dict(rms_norm_eps=0.0), ["rms_norm_eps"]),
    (dict(tie_word_embeddings="yes"), ["tie_word_embeddings"]),
])
def test_config_validation_messages(kwargs, words):
    with pytest.raises(ValueError) as e:
        LlamaConfig(**kwargs)
    for w in words:
        assert w in str(e.value)
