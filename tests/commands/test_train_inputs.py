"""`agoq train`'s inputs judged before anything is built: a plan's sequence length the model cannot take is named
as the plan's field (not as a --seq-len flag never given), and an --out holding a profile is not written into."""

import json
import os
import random

from agoq.cli import main
from agoq.formats.plan import plan_from_dict
from agoq.models import PRESETS, build, fingerprint


def _plan(tmp_path, seq_len: int):
    model = build("llama-tiny", device="meta")
    data = {"schema": "agoq.plan/1.1", "model": {"name": model.config.name, "fingerprint": fingerprint(model)},
            "layers": [{"layer": i, "stage": 0, "checkpoint": False, "kinds": {}} for i in range(3)],
            "gradients": {"mode": "bf16"}, "training": {"micro_batch": 1, "seq_len": seq_len, "grad_accum": 1}}
    plan_from_dict(data)  # a valid plan: its seq_len is a positive integer
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_a_plans_seq_len_the_model_cannot_take_is_named_as_the_plans_field(tmp_path, capsys):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    limit = PRESETS["llama-tiny"].max_position_embeddings
    seq_len = rng.choice([10**9, limit + rng.randint(1, 10**6)])
    plan = _plan(tmp_path, seq_len)
    out = tmp_path / "run"
    assert main(["train", "llama-tiny", "--plan", str(plan), "--device", "cpu", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{plan}: training.seq_len {seq_len} exceeds the model's max_position_embeddings ({limit})" in err, err
    assert "--seq-len" in err and f"--seq-len {seq_len}" not in err  # offered as a remedy, not blamed
    assert not out.exists()


def test_train_does_not_write_into_a_profile_folder(tmp_path, capsys):
    out = tmp_path / "profile"
    out.mkdir()
    header = json.dumps({"schema": "agoq.profile/1", "nonce": os.urandom(8).hex()})
    (out / "profile.json").write_text(header)
    assert main(["train", "llama-tiny", "--steps", "1", "--device", "cpu", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a profile" in err and str(out) in err
    assert sorted(p.name for p in out.iterdir()) == ["profile.json"] and (out / "profile.json").read_text() == header


def test_train_called_from_python_names_the_plans_seq_len_too(tmp_path):
    import pytest

    from agoq.train.config import JobConfig
    from agoq.train.trainer import train

    limit = PRESETS["llama-tiny"].max_position_embeddings
    seq_len = limit + random.randint(1, 10**5)
    plan = _plan(tmp_path, seq_len)
    cfg = JobConfig.from_flags(model="llama-tiny", plan=str(plan), device="cpu", quiet=True, out=str(tmp_path / "r"))
    with pytest.raises(ValueError) as info:
        train(cfg)
    assert f"training.seq_len {seq_len} exceeds" in str(info.value) and f"--seq-len {seq_len}" not in str(info.value)


def test_activations_refuses_a_model_too_big_before_building_it(tmp_path, capsys):
    hidden = 16 * random.randint(10**5, 2 * 10**5)  # head_dim even (rotary); trillions of parameters
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
                                "intermediate_size": 4 * hidden, "num_hidden_layers": 7, "num_attention_heads": 8,
                                "num_key_value_heads": 8, "vocab_size": 1000, "max_position_embeddings": 4096}))
    assert main(["activations", str(path), "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "GB" in err and "--layers" in err, err
