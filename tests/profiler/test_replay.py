"""Replaying backward gives the sensitivities of running each option's policy."""

import random

import pytest
import torch

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
    assert "attention" in REPLAYABLE
    by_policy = [meter.measure(m) for m in ms]
    notes = {}
    replayed = measure_chunk(meter, ms, method="replay", notes=notes)
    assert "replay_fallbacks" not in notes  # every measurement was replayed, none ran its policy
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


def _sessions(dtype: str, rng: random.Random):
    """(a random llama-tiny, kind -> the replay session of one random batch under that kind's reference)."""
    from agoq.profiler.replay import ReplaySession
    from agoq.profiler.sensitivity import measurement_policy, reference_kind

    model = load_model("llama-tiny", dtype=dtype, seed=rng.randint(0, 999))
    (ids,) = token_batches(256, 1, 2, rng.randint(11, 29), rng.randint(0, 999), "cpu")
    sessions = {}

    def for_kind(kind: str):
        reference = reference_kind(kind)
        if reference not in sessions:
            sessions[reference] = ReplaySession(model, ids, measurement_policy(None, reference, 64))
        return sessions[reference]
    return model, for_kind


def _options(rng: random.Random) -> list[tuple[int, str]]:
    return [(rng.randint(2, 8), "int"), (4, "nf4")]


def test_local_replay_equals_full_replay_fp32(seed):
    from agoq.profiler.replay import LOCAL_KINDS

    rng = random.Random(seed)
    _, session_of = _sessions("fp32", rng)
    for kind in sorted(LOCAL_KINDS):
        layer, session = rng.randrange(3), session_of(kind)
        for bits, fmt in _options(rng):
            local = session.error(layer, kind, bits, fmt)
            full = session.error(layer, kind, bits, fmt, _full=True)
            assert full > 0, (layer, kind, bits, fmt)
            assert local == pytest.approx(full, rel=1e-6, abs=0), (layer, kind, bits, fmt)
    assert session.noise_floor(layer, local=True) == 0.0


def test_local_replay_equals_policy_run_bf16(seed):
    """In bf16 the local replay gives the sensitivity of running the option's policy, as the full one does."""
    from agoq.profiler.replay import LOCAL_KINDS

    rng = random.Random(seed)
    model = load_model("llama-tiny", dtype="bf16", seed=rng.randint(0, 999))
    meter = SensitivityMeter(model, token_batches(256, 2, 2, rng.randint(11, 29), rng.randint(0, 999), "cpu"),
                             block=64)
    ms = [Measurement(rng.randrange(3), kind, str(bits), fmt) for kind in sorted(LOCAL_KINDS)
          for bits, fmt in _options(rng)]
    replayed = measure_chunk(meter, ms, method="replay")
    for m, r in zip(ms, replayed):
        assert r["sensitivity"] == pytest.approx(meter.measure(m), rel=1e-5, abs=0), m


def _moved_outside_layer(session, model, layer: int, kind: str, bits: int, fmt: str) -> list[str]:
    """Names of the parameters outside `layer` whose full-replay gradient differs from the reference's."""
    from agoq.runtime.activations.saved_bytes import find_decoder_layers

    got, ref = session.replay(layer, kind, bits, fmt, local=False)
    inside = {id(p) for p in find_decoder_layers(model)[layer].parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    moved = []
    for p, g, r in zip(session.params, got, ref):
        if id(p) in inside or (g is None and r is None):
            continue
        if g is None or r is None or not torch.equal(g, r):
            moved.append(names[id(p)])
    return moved


def test_local_kinds_change_no_gradient_outside_their_layer(seed):
    from agoq.profiler.replay import LOCAL_KINDS

    rng = random.Random(seed)
    model, session_of = _sessions("fp32", rng)
    for kind in sorted(LOCAL_KINDS):
        layer = rng.randrange(1, 3)  # a layer with layers below it
        bits, fmt = rng.choice(_options(rng))
        assert _moved_outside_layer(session_of(kind), model, layer, kind, bits, fmt) == [], (layer, kind, bits, fmt)


@pytest.mark.parametrize("kind", ["norm_input", "silu_input"])
def test_other_kinds_change_gradients_below_their_layer(seed, kind):
    """The kinds left out of LOCAL_KINDS must be: their substitution reaches the layers below."""
    from agoq.profiler.replay import LOCAL_KINDS

    assert kind not in LOCAL_KINDS
    rng = random.Random(seed)
    model, session_of = _sessions("fp32", rng)
    layer = rng.randrange(1, 3)
    moved = _moved_outside_layer(session_of(kind), model, layer, kind, rng.randint(2, 4), "int")
    below = [n for n in moved if any(f"layers.{i}." in n for i in range(layer))]
    assert below, f"{kind} at layer {layer} changed no gradient below it"


def _attention_calls(monkeypatch) -> list:
    """Records the setting of every call of LAAQ's attention function (which still runs)."""
    from agoq.runtime.activations import laaq

    calls, real = [], laaq._QuantizedAttention.apply
    monkeypatch.setattr(laaq._QuantizedAttention, "apply",
                        lambda q, k, v, cfg, setting, kw: calls.append(setting) or real(q, k, v, cfg, setting, kw))
    return calls


def _loss_and_grads(model, ids):
    from agoq.profiler.model_source import next_token_loss

    model.zero_grad(set_to_none=True)
    loss = next_token_loss(model, ids)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_rerun_kept_attention_switch_is_scoped_and_exact(seed, monkeypatch):
    """Outside the switch a 16-bit attention runs the fused attention (LAAQ's function is not called, nothing
    of attention is observed); under it LAAQ's function keeps q, k, v and the loss and gradients are the same."""
    from agoq.profiler.sensitivity import measurement_policy
    from agoq.runtime.activations.laaq import (
        apply_activation_policy,
        observe_kept_tensors,
        remove_activation_policy,
        rerun_kept_attention,
    )
    from agoq.runtime.activations.policy import KEEP

    rng = random.Random(seed)
    model = load_model("llama-tiny", dtype="fp32", seed=rng.randint(0, 999))
    (ids,) = token_batches(256, 1, 2, rng.randint(11, 29), rng.randint(0, 999), "cpu")
    calls = _attention_calls(monkeypatch)
    seen = []
    apply_activation_policy(model, measurement_policy(None, "qkv_input", 64))  # every layer in LAAQ, attention 16
    try:
        with observe_kept_tensors(lambda kind, t, setting: seen.append((kind, setting))):
            loss, grads = _loss_and_grads(model, ids)
            assert calls == [] and not any(kind == "attention" for kind, _ in seen)
            with rerun_kept_attention():
                loss_switched, grads_switched = _loss_and_grads(model, ids)
            assert calls == [KEEP] * 3 and [s for k, s in seen if k == "attention"] == [KEEP] * 9
            calls.clear()
            _loss_and_grads(model, ids)  # the switch is off again once left
            assert calls == []
    finally:
        remove_activation_policy(model)
    torch.testing.assert_close(loss_switched, loss, rtol=1e-6, atol=0)
    assert len(grads_switched) == len(grads)
    for g, r in zip(grads_switched, grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_attention_needs_a_session_built_for_it(seed):
    rng = random.Random(seed)
    _, session_of = _sessions("fp32", rng)
    with pytest.raises(ValueError, match="attention=True"):
        session_of("attention").error(rng.randrange(3), "attention", 4, "int")
