"""RoPE scaling types and the Qwen2 / Mistral families against HuggingFace transformers' own models,
on fresh random parameters and inputs at non-round sizes; config parsing, round trips and refusals."""

from __future__ import annotations

import inspect
import json
import random

import pytest
import torch

from agoq.models import PRESETS, LlamaConfig, build, fingerprint, resolve_config
from agoq.models.llama import RotaryEmbedding
from agoq.models.rope_scaling import SUPPORTED_ROPE_TYPES

transformers = pytest.importorskip("transformers")
_HF5 = "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters

# a tiny model with a non-round head size; max_position_embeddings 96, the "original" context 40
_SHAPE = dict(vocab_size=89, hidden_size=52, intermediate_size=70, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=26, max_position_embeddings=96, rms_norm_eps=1e-6)
_ORIG = 40


def _random_scaling(rope_type: str, rng: random.Random) -> dict:
    """A fresh random scaling of the given type (non-round factors)."""
    half = _SHAPE["head_dim"] // 2
    if rope_type in ("linear", "dynamic"):
        return {"rope_type": rope_type, "factor": rng.uniform(1.5, 9.0)}
    if rope_type == "llama3":
        low = rng.uniform(0.7, 1.5)
        return {"rope_type": "llama3", "factor": rng.uniform(4.0, 40.0), "low_freq_factor": low,
                "high_freq_factor": low + rng.uniform(2.0, 5.0), "original_max_position_embeddings": _ORIG}
    if rope_type == "yarn":
        return {"rope_type": "yarn", "factor": rng.uniform(2.0, 16.0), "original_max_position_embeddings": _ORIG,
                "beta_fast": rng.uniform(20.0, 40.0), "beta_slow": rng.uniform(0.5, 2.0)}
    if rope_type == "yarn-mscale":
        return {"rope_type": "yarn", "factor": rng.uniform(2.0, 16.0), "original_max_position_embeddings": _ORIG,
                "mscale": rng.uniform(0.5, 1.5), "mscale_all_dim": rng.uniform(0.5, 1.5), "truncate": False}
    if rope_type == "longrope":
        return {"rope_type": "longrope", "original_max_position_embeddings": _ORIG,
                "short_factor": [rng.uniform(1.0, 1.3) for _ in range(half)],
                "long_factor": [rng.uniform(1.0, 12.0) for _ in range(half)]}
    raise AssertionError(rope_type)


def _hf_llama_config(scaling: dict, theta: float):
    """A transformers LlamaConfig with this scaling, spelled as the installed version writes it."""
    if _HF5:
        return transformers.LlamaConfig(**_SHAPE, rope_parameters={**scaling, "rope_theta": theta},
                                        attn_implementation="eager")
    return transformers.LlamaConfig(**_SHAPE, rope_theta=theta, rope_scaling=dict(scaling),
                                    attn_implementation="eager")


def _hf_tables(hf_config, seq: int):
    """cos, sin and inv_freq of a fresh transformers rotary embedding for positions 0..seq-1."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf_config)  # fresh: no cached lengths
    x = torch.empty(1, seq, 4)
    cos, sin = rotary(x, torch.arange(seq)[None])
    return cos, sin, rotary.inv_freq.clone()


_TYPES = ["linear", "dynamic", "llama3", "yarn", "yarn-mscale", "longrope"]
# sequence lengths: within the original context, between it and max_position_embeddings, beyond both
_SEQS = [29, 67, 131]


@pytest.mark.parametrize("rope_type", _TYPES)
def test_tables_match_transformers(rope_type, seed):
    rng = random.Random(seed)
    seed = rng.randrange(2**31)
    rng.seed(seed)
    theta = rng.uniform(3000.0, 600000.0)
    scaling = _random_scaling(rope_type, rng)
    hf_config = _hf_llama_config(scaling, theta)
    ours = LlamaConfig.from_dict(json.loads(json.dumps(hf_config.to_dict())))  # as a file HF wrote
    assert ours.rope_scaling["rope_type"] == scaling["rope_type"]
    assert ours.rope_theta == pytest.approx(theta)
    rotary = build(ours, device="meta").model.rotary_emb
    for seq in _SEQS:
        ref_cos, ref_sin, ref_inv = _hf_tables(hf_config, seq)
        pos = torch.arange(seq)[None]
        inv = rotary.inv_freq(seq_len=torch.tensor(seq))
        msg = f"seed {seed}, {scaling}, seq {seq}"
        torch.testing.assert_close(inv, ref_inv, rtol=2e-6, atol=0, msg=lambda m: f"{msg}: {m}")
        cos, sin = rotary(torch.empty(1, seq, 4), pos)
        # angles reach ~130 rad: float32 rounding of inv_freq times the position
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=3e-5, msg=lambda m: f"{msg}: {m}")
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=3e-5, msg=lambda m: f"{msg}: {m}")


def _copy_into_hf(ours, hf):
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and not missing, (missing, unexpected)


def _perturb(model, g):
    with torch.no_grad():  # non-trivial norm weights and biases so that every parameter matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("rope_type", ["llama3", "yarn", "longrope", "dynamic"])
def test_full_forward_matches_transformers(rope_type, seed):
    rng = random.Random(seed)
    seed = rng.randrange(2**31)
    rng.seed(seed)
    theta = rng.uniform(3000.0, 600000.0)
    hf_config = _hf_llama_config(_random_scaling(rope_type, rng), theta)
    cfg = LlamaConfig.from_dict(hf_config.to_dict())
    g = torch.Generator().manual_seed(seed)
    ours = build(cfg, seed=seed % 1000)
    _perturb(ours, g)
    for seq in (37, 83, 113):  # within the original context, beyond it, beyond max_position_embeddings
        hf = transformers.LlamaForCausalLM(hf_config).float().eval()
        _copy_into_hf(ours, hf)
        ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=g)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"seed {seed}, seq {seq}: {m}")


def test_our_dict_reads_back_and_into_transformers(seed):
    rng = random.Random(seed)
    for rope_type in _TYPES:
        cfg = LlamaConfig.from_dict({**_SHAPE, "rope_theta": 77777.0, "rope_scaling": _random_scaling(rope_type, rng)})
        d = json.loads(json.dumps(cfg.to_dict()))
        assert LlamaConfig.from_dict(d) == cfg
        # transformers reads the same file to the same tables (rope_scaling is the spelling both versions read)
        hf_d = {k: v for k, v in d.items() if k != "name"}
        hf_config = transformers.LlamaConfig(**hf_d)
        ref_cos, ref_sin, _ = _hf_tables(hf_config, 61)
        cos, sin = build(cfg, device="meta").model.rotary_emb(torch.empty(1, 61, 4), torch.arange(61)[None])
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=3e-5)
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=3e-5)


def test_spellings_and_defaults():
    base = {**_SHAPE, "rope_theta": 5e5}
    l3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 40}
    a = LlamaConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3", **l3}})
    b = LlamaConfig.from_dict({**_SHAPE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **l3}})
    c = LlamaConfig.from_dict({**base, "rope_scaling": {"type": "llama3", **l3}})  # the oldest spelling
    assert a == b == c and a.rope_scaling == {"rope_type": "llama3", **l3}
    # a default rope type is plain RoPE; a top-level original_max_position_embeddings wins (as in transformers)
    assert LlamaConfig.from_dict({**base, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    y = LlamaConfig.from_dict({**base, "original_max_position_embeddings": 24,
                               "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert y.rope_scaling == {"rope_type": "yarn", "original_max_position_embeddings": 24, "factor": 4.0}
    y = LlamaConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert y.rope_scaling["original_max_position_embeddings"] == 96  # defaults to max_position_embeddings


def test_llama_32_1b_preset_is_the_real_config():
    real = {  # the published meta-llama/Llama-3.2-1B config.json
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
    assert LlamaConfig.from_dict({**real, "name": "llama-3.2-1b"}) == PRESETS["llama-3.2-1b"]
    assert PRESETS["llama-3-8b"].rope_scaling is None  # the original Llama-3-8B has none
    # the preset's rotary tables are transformers' for the real config
    hf_config = transformers.LlamaConfig(**{k: v for k, v in real.items() if k != "architectures"})
    ref_cos, ref_sin, ref_inv = _hf_tables(hf_config, 50)
    cfg = PRESETS["llama-3.2-1b"]
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    torch.testing.assert_close(rotary.inv_freq(), ref_inv, rtol=1e-6, atol=0)
    cos, sin = rotary(torch.empty(1, 50, 4), torch.arange(50)[None])
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-5)


def test_unsupported_and_malformed_scalings_are_refused():
    for key in ("rope_scaling", "rope_parameters"):
        with pytest.raises(NotImplementedError) as e:
            LlamaConfig.from_dict({**_SHAPE, key: {"rope_type": "proportional", "rope_theta": 1e4}})
        msg = str(e.value)
        assert key in msg and "'proportional'" in msg
        for t in SUPPORTED_ROPE_TYPES:
            assert repr(t) in msg
    with pytest.raises(NotImplementedError, match="partial_rotary_factor"):
        LlamaConfig.from_dict({**_SHAPE, "rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                                          "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="'factor'"):
        LlamaConfig.from_dict({**_SHAPE, "rope_scaling": {"rope_type": "linear"}})
    with pytest.raises(ValueError, match="factor must be a positive number"):
        LlamaConfig.from_dict({**_SHAPE, "rope_scaling": {"rope_type": "dynamic", "factor": -2}})
    with pytest.raises(ValueError, match="high_freq_factor"):
        LlamaConfig.from_dict({**_SHAPE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                          "high_freq_factor": 1.0}})
    with pytest.raises(ValueError, match="short_factor has 3 entries.*13"):
        LlamaConfig.from_dict({**_SHAPE, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                                          "long_factor": [2.0] * 13}})
    with pytest.raises(ValueError, match="rope_scaling must be a dict"):
        LlamaConfig.from_dict({**_SHAPE, "rope_scaling": "llama3"})


# ---------------------------------------------------------------------------
# Qwen2 and Mistral
# ---------------------------------------------------------------------------

_FAMILY = dict(vocab_size=83, hidden_size=56, intermediate_size=74, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=72, rms_norm_eps=1e-6, rope_theta=31000.0,
               hidden_act="silu", tie_word_embeddings=False)


@pytest.mark.parametrize("family,extra", [
    ("qwen2", {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 1}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 72, "max_window_layers": 1,
               "tie_word_embeddings": True}),
    ("mistral", {"sliding_window": None, "head_dim": 14}),
    ("mistral", {"sliding_window": 80}),
])
def test_families_match_transformers(family, extra):
    d = {**_FAMILY, **extra, "model_type": family}
    hf_config = transformers.AutoConfig.for_model(**{**d, "attn_implementation": "eager"})
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    cfg = LlamaConfig.from_dict(json.loads(json.dumps(hf_config.to_dict())))
    assert cfg.model_type == family and cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    g = torch.Generator().manual_seed(random.randrange(2**31))
    ours = build(cfg, seed=4)
    _perturb(ours, g)
    assert fingerprint(ours) == fingerprint(hf)  # a plan profiled on transformers' model applies to ours
    _copy_into_hf(ours, hf)
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, cfg.vocab_size, (2, 71), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=2e-5, rtol=2e-5)
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_family_biases_defaults_and_sliding_window_refusals():
    q = resolve_config({**_FAMILY, "model_type": "qwen2"})
    attn = build(q).model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.v_proj.bias is not None and attn.o_proj.bias is None
    m = resolve_config({k: v for k, v in _FAMILY.items() if k not in ("rms_norm_eps", "max_position_embeddings")}
                       | {"model_type": "mistral", "sliding_window": None})
    assert m.rms_norm_eps == 1e-6 and m.max_position_embeddings == 131072  # transformers' Mistral defaults

    # Mistral-7B-v0.1: a 4096-token window but 32768 positions
    with pytest.raises(NotImplementedError) as e:
        resolve_config({**_FAMILY, "model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768})
    assert "sliding_window 4096" in str(e.value) and "32768" in str(e.value)
    with pytest.raises(NotImplementedError, match="sliding_window 4096"):  # the key missing: Mistral's default
        resolve_config({**_FAMILY, "model_type": "mistral", "max_position_embeddings": 8192})
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        resolve_config({**_FAMILY, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
                        "max_window_layers": 1})
    # a sliding window on no layer masks nothing
    assert resolve_config({**_FAMILY, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
                           "max_window_layers": 2}).model_type == "qwen2"
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig(model_type="mistral", attention_bias=True)
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig(model_type="gemma")
