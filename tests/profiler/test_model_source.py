"""Models from HuggingFace config.json files: LLaMA through agoq's model, Qwen2 through transformers."""

import json

import pytest
import torch

from agoq.profiler.model_source import (
    layer_shape,
    load_model,
    next_token_loss,
    token_batches,
)
from agoq.profiler.options import Option, option_bytes
from agoq.profiler.sensitivity import Measurement, SensitivityMeter, measure_chunk

SMALL = {"vocab_size": 97, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "hidden_act": "silu", "rms_norm_eps": 1e-6}


def test_llama_config(tmp_path):
    path = tmp_path / "my-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**SMALL, "model_type": "llama"}))
    model = load_model(str(path), dtype="fp32")
    assert type(model).__module__.startswith("agoq.")
    assert layer_shape(model, 2, 9).hidden == 48


def test_qwen2_config_through_transformers(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, "model_type": "qwen2", "tie_word_embeddings": False}))
    model = load_model(str(path), dtype="fp32", num_layers=1)
    assert type(model).__module__.startswith("transformers.")
    shape = layer_shape(model, 2, 11)
    assert (shape.hidden, shape.intermediate, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (48, 80, 4, 2, 12)
    batches = token_batches(97, 1, 2, 11, 0, "cpu")
    assert torch.isfinite(next_token_loss(model, batches[0]))
    meter = SensitivityMeter(model, batches)
    ms = [Measurement(0, "silu_input", "4", "int"), Measurement(0, "attention", "3", "int")]
    policy_run = [meter.measure(m) for m in ms]
    rows = measure_chunk(meter, ms)  # silu_input replayed, attention by its policy
    assert [r["sensitivity"] for r in rows] == pytest.approx(policy_run, rel=1e-6)
    assert all(s > 0 for s in policy_run)
    assert rows[0]["bytes_measured"] == option_bytes(shape, "silu_input", Option("4", 4, "int"), 128)[0]
