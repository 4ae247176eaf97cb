"""Replaying backward gives the sensitivities of running each option's policy."""

import random

import pytest

from agoq.profiler.model_source import load_model, token_batches
from agoq.profiler.replay import REPLAYABLE
from agoq.profiler.sensitivity import Measurement, SensitivityMeter, measure_chunk


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_replay_equals_policy_runs(dtype, seed):
    rng = random.Random(seed)
    model = load_model("llama-tiny", dtype=dtype, seed=rng.randint(0, 999))
    meter = SensitivityMeter(model, token_batches(256, 2, 2, rng.randint(11, 29), rng.randint(0, 999), "cpu"),
                             block=64)
    ms = [Measurement(rng.randrange(3), kind, str(bits), fmt) for kind in REPLAYABLE
          for bits, fmt in ((2, "int"), (4, "nf4"), (rng.choice([3, 5, 6, 8]), "int"))]
    by_policy = [meter.measure(m) for m in ms]
    replayed = measure_chunk(meter, ms, method="replay")
    by_policy_chunk = measure_chunk(meter, ms, method="policy")
    assert [r["sensitivity"] for r in by_policy_chunk] == by_policy
    for m, r, p in zip(ms, replayed, by_policy):
        assert r["sensitivity"] == pytest.approx(p, rel=1e-5, abs=0), m
        assert r["bytes_measured"] is not None and r["bytes_measured"] > 0


def test_measurements_replay_cannot_run_fall_back_to_their_policy(monkeypatch):
    from agoq.profiler import replay

    model = load_model("llama-tiny", dtype="fp32", seed=2)
    meter = SensitivityMeter(model, token_batches(256, 2, 2, 17, 3, "cpu"), block=64)
    ms = [Measurement(1, "ffn1_input", "3", "int"), Measurement(2, "o_proj_input", "5", "int")]
    expected = [meter.measure(m) for m in ms]
    real = replay.ReplaySession.error

    def broken(self, layer, kind, bits, fmt):
        if kind == "ffn1_input":
            raise RuntimeError("replay of this kind: backward never read the kept tensor")
        return real(self, layer, kind, bits, fmt)

    monkeypatch.setattr(replay.ReplaySession, "error", broken)
    notes = {}
    got = measure_chunk(meter, ms, notes=notes)
    assert [r["sensitivity"] for r in got] == pytest.approx(expected, rel=1e-6)
    assert notes["replay_fallbacks"] == 1 and notes["replay_noise_floor"] == 0.0
