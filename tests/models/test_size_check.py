"""A model too big for the device is refused from its config, before anything is built (agoq.models.size_check):
the parameter count of the formula is the built model's, and a huge config is refused at once with the numbers."""

import json
import os
import random

import pytest

from agoq.cli import main
from agoq.models import LlamaConfig, build
from agoq.models.size_check import check_fits, layers_that_fit, step_floor


def _random_config(rng: random.Random) -> LlamaConfig:
    """A small config of non-round sizes: odd vocabularies and widths, GQA, any family, biases, tied or not."""
    family = rng.choice(["llama", "qwen2", "mistral"])
    kv = rng.choice([1, 2, 3])
    heads = kv * rng.choice([1, 2, 3])
    head_dim = 2 * rng.randint(2, 7)
    bias = family == "llama" and rng.random() < 0.5
    return LlamaConfig(vocab_size=rng.randint(50, 301), hidden_size=heads * head_dim + rng.choice([0, 2, 6]),
                       intermediate_size=rng.randint(17, 97), num_hidden_layers=rng.randint(1, 4),
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                       attention_bias=bias, mlp_bias=bias and rng.random() < 0.5,
                       tie_word_embeddings=rng.random() < 0.5, model_type=family, max_position_embeddings=64)


@pytest.mark.parametrize("seed", [int.from_bytes(os.urandom(4), "little") for _ in range(3)])
def test_parameter_formula_is_the_built_models_count(seed):
    rng = random.Random(seed)
    print("seed", seed)
    for _ in range(4):
        config = _random_config(rng)
        model = build(config, device="meta")  # shapes only: nothing allocated
        params = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once
        assert config.num_parameters() == params, config
        for dtype, e in (("bf16", 2), ("fp32", 4)):
            floor = step_floor(config, dtype=dtype, seq_len=11, optimizer="adamw", master="fp32")
            assert floor.weights == sum(p.numel() * e for p in model.parameters())
            assert floor.optimizer == params * (8 + (4 if dtype == "bf16" else 0))
            assert floor.activations == e * 11 * config.hidden_size * (config.num_hidden_layers + 1)


@pytest.mark.parametrize("seed", [int.from_bytes(os.urandom(4), "little") for _ in range(2)])
def test_the_layers_said_to_fit_fit_and_one_more_does_not(seed):
    import dataclasses

    rng = random.Random(seed)
    print("seed", seed)
    config = dataclasses.replace(_random_config(rng), num_hidden_layers=1000)
    args = dict(dtype="bf16", seq_len=rng.randint(5, 300), optimizer="adamw8bit", master="fp32")
    available = rng.randint(10**6, 10**8)
    fit = layers_that_fit(config, available, **args)

    def need(layers):
        return step_floor(dataclasses.replace(config, num_hidden_layers=layers), **args).total

    assert need(fit + 1) > available
    assert fit == 0 or need(fit) <= available


def test_a_huge_config_is_refused_naming_the_numbers():
    config = LlamaConfig(hidden_size=10**7, num_attention_heads=10**5, intermediate_size=1000, num_hidden_layers=2,
                         vocab_size=32000)
    with pytest.raises(ValueError) as e:
        check_fits(config, device="cpu", dtype="bf16", seq_len=64, what="model huge", fewer_layers="--layers N",
                   available=16 * 10**9)
    message = str(e.value)
    need = step_floor(config, dtype="bf16", seq_len=64).total
    assert f"needs at least {need / 1e9:.1f} GB" in message and "16.0 GB" in message
    assert "not even one layer fits" in message and "--seq-len" in message and "more memory" in message


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if any model is built; the machine's memory reads as 16 GB."""
    import agoq.models.factory as factory
    import agoq.models.size_check as size_check

    def refuse(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(factory, "LlamaForCausalLM", refuse)  # what agoq.models.build makes
    monkeypatch.setattr(size_check, "available_bytes", lambda device: (16 * 10**9, "RAM available (test)"))


def test_profile_and_train_refuse_a_huge_config_before_building(tmp_path, capsys, nothing_built):
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 176,
                                "num_hidden_layers": 100_000, "vocab_size": 256}))
    config = LlamaConfig.from_dict({**json.loads(deep.read_text()), "name": "deep"})
    assert main(["profile", str(deep), "--device", "cpu", "--seq-len", "32", "--quiet",
                 "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    # the profile's floor: fp32 on the CPU, weights + gradients + 8-bit moments on float32 masters (none for fp32)
    need = step_floor(config, dtype="fp32", seq_len=32, optimizer="adamw8bit", master="fp32").total
    assert f"needs at least {need / 1e9:.1f} GB" in err and "but 16.0 GB" in err and "--layers" in err, err
    fit = layers_that_fit(config, 16 * 10**9, dtype="fp32", seq_len=32, optimizer="adamw8bit", master="fp32")
    assert f"at most {fit} of its 100000 layers" in err
    assert main(["train", str(deep), "--device", "cpu", "--quiet", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    need = step_floor(config, dtype="fp32", seq_len=256, optimizer="adamw", master="fp32").total  # train's defaults
    assert f"needs at least {need / 1e9:.1f} GB" in err and "num_hidden_layers" in err, err
    assert not (tmp_path / "p").exists() and not (tmp_path / "t").exists()


def test_llama_3_8b_on_a_16gb_cpu_is_refused(tmp_path, capsys, nothing_built):
    assert main(["train", "llama-3-8b", "--device", "cpu", "--quiet", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "8,030,261,248 parameters" in err and "16.0 GB" in err and "Traceback" not in err
