"""Activation policies: setting validation, presets, stage-aware bit widths and (de)serialisation."""

import json
import random

import pytest

import agoq
from agoq import ActivationPolicy, preset, stage_aware_policy, stage_bits

KINDS = ("norm_input", "qkv_input", "attention", "o_proj_input", "ffn1_input", "silu_input", "ffn2_input")
RECOMPUTABLE_KINDS = ("qkv_input", "ffn1_input", "ffn2_input")
VALID_BITS = (2, 3, 4, 5, 6, 7, 8, 16)


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def test_kinds_are_the_documented_ones():
    assert tuple(agoq.KINDS) == KINDS


# ---------------------------------------------------------------------------
# settings validation
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", VALID_BITS)
def test_valid_bit_widths_accepted(kind, bits):
    p = ActivationPolicy(default={kind: bits})
    assert p.settings(0)[kind] == bits
    assert p.settings(5)[kind] == bits
    # the other kinds are filled in with 16 (keep)
    assert all(p.settings(0)[k] == 16 for k in KINDS if k != kind)
    q = ActivationPolicy(layers={2: {kind: bits}})
    assert q.settings(2)[kind] == bits
    assert q.settings(1)[kind] == 16


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [1, 9, 12, 0, -4, 32, "x", True, False, 4.5, 8.0, None])
def test_bad_bit_widths_rejected_naming_the_kind(kind, bad):
    with pytest.raises(ValueError, match=kind):
        ActivationPolicy(default={kind: bad})
    with pytest.raises(ValueError, match=kind):
        ActivationPolicy(layers={1: {kind: bad}})


@pytest.mark.parametrize("kind", RECOMPUTABLE_KINDS)
def test_recompute_allowed_for_recomputable_kinds(kind):
    p = ActivationPolicy(default={kind: "recompute"})
    assert p.settings(0)[kind] == "recompute"
    assert not p.keeps_everything(0)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in RECOMPUTABLE_KINDS])
def test_recompute_rejected_elsewhere_with_the_kinds_that_can(kind):
    for kwargs in ({"default": {kind: "recompute"}}, {"layers": {0: {kind: "recompute"}}}):
        with pytest.raises(ValueError) as e:
            ActivationPolicy(**kwargs)
        msg = str(e.value)
        assert kind in msg
        for can in RECOMPUTABLE_KINDS:
            assert can in msg, f"message does not say that {can} can be recomputed: {msg}"


@pytest.mark.parametrize("where", ["default", "layers"])
def test_unknown_kind_rejected(where):
    kwargs = {"default": {"mlp_output": 4}} if where == "default" else {"layers": {0: {"mlp_output": 4}}}
    with pytest.raises(ValueError, match="mlp_output"):
        ActivationPolicy(**kwargs)


def test_negative_layer_and_bad_quantization_options_rejected():
    with pytest.raises(ValueError, match="-1"):
        ActivationPolicy(layers={-1: {"norm_input": 4}})
    with pytest.raises(ValueError, match="block"):
        ActivationPolicy(block=100)
    with pytest.raises(ValueError, match="format"):
        ActivationPolicy(format="fp4")
    with pytest.raises(ValueError, match="rounding"):
        ActivationPolicy(rounding="up")


def test_layer_overrides_only_touch_their_layer():
    seed, rng = fresh_rng()
    default = {k: rng.choice(VALID_BITS) for k in KINDS}
    over = {k: rng.choice(VALID_BITS) for k in rng.sample(KINDS, 3)}
    layer = rng.randrange(0, 20)
    p = ActivationPolicy(default=default, layers={layer: over})
    for i in range(21):
        expect = dict(default)
        if i == layer:
            expect.update(over)
        assert p.settings(i) == expect, f"seed {seed} layer {i}"
        assert p.keeps_everything(i) == all(v == 16 for v in expect.values()), f"seed {seed} layer {i}"


# ---------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------

def test_bf16_preset_keeps_everything():
    p = preset("bf16")
    for i in (0, 1, 7, 100):
        assert p.keeps_everything(i)
        assert p.settings(i) == {k: 16 for k in KINDS}


def test_agoq_paper_preset_exactly():
    expect = {"norm_input": 4, "qkv_input": "recompute", "attention": 16, "o_proj_input": 4,
              "ffn1_input": "recompute", "silu_input": 4, "ffn2_input": "recompute"}
    p = preset("agoq-paper")
    for i in (0, 3, 31):
        assert p.settings(i) == expect
        assert not p.keeps_everything(i)
    assert p.name == "agoq-paper"


@pytest.mark.parametrize("name,bits", [("int8", 8), ("int4", 4), ("int2", 2)])
def test_uniform_presets(name, bits):
    p = preset(name)
    for i in (0, 2, 15):
        assert p.settings(i) == {k: bits for k in KINDS}
    assert p.name == name


def test_preset_options_pass_through():
    p = preset("int4", block=64, format="nf4", rounding="stochastic")
    assert (p.block, p.format, p.rounding) == (64, "nf4", "stochastic")
    with pytest.raises(ValueError, match="block"):
        preset("int4", block=48)


@pytest.mark.parametrize("name", ["int3", "fp8", "", "AGOQ-PAPER", "bf16 "])
def test_unknown_preset_lists_presets(name):
    with pytest.raises(ValueError) as e:
        preset(name)
    for known in ("bf16", "agoq-paper", "int8", "int4", "int2"):
        assert known in str(e.value)


# ---------------------------------------------------------------------------
# stage_bits
# ---------------------------------------------------------------------------

def brute_stage_bits(in_flight, base=4):
    """max(base, floor(base*N1/Ni)) capped at 8, with the floor found by search, not by division."""
    out = []
    for n in in_flight:
        b = 0
        while (b + 1) * n <= base * in_flight[0]:
            b += 1
        out.append(min(8, max(base, b)))
    return out


def test_stage_bits_paper_example():
    bits = stage_bits([11, 9, 7, 5])
    assert list(bits) == [4, 4, 6, 8]
    for b, n in zip(bits, [11, 9, 7, 5]):
        assert b * n <= 4 * 11


def test_stage_bits_matches_bruteforce_on_random_lists():
    seed, rng = fresh_rng()
    for _ in range(300):
        in_flight = [rng.randint(1, 70) for _ in range(rng.randint(1, 9))]
        assert list(stage_bits(in_flight)) == brute_stage_bits(in_flight), f"seed {seed}: {in_flight}"
    for _ in range(100):
        base = rng.randint(2, 8)
        in_flight = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        assert list(stage_bits(in_flight, base_bits=base)) == brute_stage_bits(in_flight, base), \
            f"seed {seed}: {in_flight} base {base}"


def test_no_stage_exceeds_stage_one_on_decreasing_lists():
    seed, rng = fresh_rng()
    for _ in range(300):
        k = rng.randint(1, 10)
        in_flight = sorted((rng.randint(1, 64) for _ in range(k)), reverse=True)
        bits = stage_bits(in_flight)
        assert len(bits) == k
        assert bits[0] == 4, f"seed {seed}: {in_flight} -> {bits}"
        for b, n in zip(bits, in_flight):
            assert 4 <= b <= 8, f"seed {seed}: {in_flight} -> {bits}"
            assert b * n <= 4 * in_flight[0], f"seed {seed}: stage with {n} in flight at {b} bits exceeds stage 1"
            # and it is the widest such width: one more bit would exceed stage 1 (or the 8-bit cap)
            assert b == 8 or (b + 1) * n > 4 * in_flight[0], f"seed {seed}: {in_flight} -> {bits}"
        assert all(x <= y for x, y in zip(bits, bits[1:])), f"seed {seed}: {in_flight} -> {bits}"


@pytest.mark.parametrize("bad", [[], None, [0], [5, 0], [3, -2], [4.0, 2], [True, 3], ["4"], [4, None]])
def test_stage_bits_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        stage_bits(bad)


# ---------------------------------------------------------------------------
# stage_aware_policy
# ---------------------------------------------------------------------------

def paper_settings(bits):
    return {"norm_input": bits, "qkv_input": "recompute", "attention": 16, "o_proj_input": bits,
            "ffn1_input": "recompute", "silu_input": bits, "ffn2_input": "recompute"}


def test_stage_aware_split_is_contiguous_and_even():
    seed, rng = fresh_rng()
    in_flight = [8, 6, 5, 4]  # stage bits 4, 5, 6, 8: each stage recognisable from its layers' bits
    bits = brute_stage_bits(in_flight)
    assert len(set(bits)) == 4
    for num_layers in sorted({4, 5, 7, 10, 13} | {rng.randint(4, 61) for _ in range(8)}):
        p = stage_aware_policy(in_flight, num_layers)
        stages = []
        for i in range(num_layers):
            s = p.settings(i)
            stages.append(bits.index(s["norm_input"]))
            assert s == paper_settings(bits[stages[-1]]), f"seed {seed}, {num_layers} layers, layer {i}"
        assert stages[0] == 0 and stages[-1] == 3, f"seed {seed}: {stages}"
        assert all(b - a in (0, 1) for a, b in zip(stages, stages[1:])), f"not contiguous: {stages}"
        counts = [stages.count(s) for s in range(4)]
        assert max(counts) - min(counts) <= 1, f"uneven split for {num_layers} layers: {counts}"


def test_stage_aware_layers_carry_their_stage_bits():
    seed, rng = fresh_rng()
    for _ in range(30):
        k = rng.randint(1, 6)
        in_flight = sorted((rng.randint(1, 30) for _ in range(k)), reverse=True)
        num_layers = rng.randint(k, 3 * k + 2)
        layer_stage = sorted(rng.randrange(k) for _ in range(num_layers))
        p = stage_aware_policy(in_flight, num_layers, layer_stage=layer_stage)
        bits = brute_stage_bits(in_flight)
        for i, s in enumerate(layer_stage):
            assert p.settings(i) == paper_settings(bits[s]), f"seed {seed}: {in_flight} {layer_stage} layer {i}"
        # each bit width the policy uses appears in its name
        for b in set(bits[s] for s in layer_stage):
            assert str(b) in p.name


def test_stage_aware_rejects_bad_shapes():
    with pytest.raises(ValueError):
        stage_aware_policy([11, 9, 7, 5], 3)  # fewer layers than stages
    with pytest.raises(ValueError):
        stage_aware_policy([11, 9], 4, layer_stage=[0, 0, 1])  # one stage per layer needed
    with pytest.raises(ValueError):
        stage_aware_policy([11, 9], 3, layer_stage=[0, 1, 2])  # stage 2 does not exist
    with pytest.raises(ValueError):
        stage_aware_policy([], 3)


# ---------------------------------------------------------------------------
# serialisation
# ---------------------------------------------------------------------------

def random_policy(rng):
    def setting(kind):
        choices = list(VALID_BITS) + (["recompute"] if kind in RECOMPUTABLE_KINDS else [])
        return rng.choice(choices)

    default = {k: setting(k) for k in rng.sample(KINDS, rng.randint(0, len(KINDS)))}
    layers = {rng.randrange(0, 40): {k: setting(k) for k in rng.sample(KINDS, rng.randint(1, 4))}
              for _ in range(rng.randint(0, 5))}
    return ActivationPolicy(default=default, layers=layers, block=rng.choice([32, 64, 128, 512, 4096]),
                            format=rng.choice(["int", "nf4"]), rounding=rng.choice(["nearest", "stochastic"]),
                            name=f"p{rng.randrange(1000)}")


def test_to_dict_from_dict_round_trip():
    seed, rng = fresh_rng()
    for _ in range(50):
        p = random_policy(rng)
        back = ActivationPolicy.from_dict(p.to_dict())
        assert back == p, f"seed {seed}"
        via_json = ActivationPolicy.from_dict(json.loads(json.dumps(p.to_dict())))
        assert via_json == p, f"seed {seed}"
        assert ActivationPolicy.from_dict(json.loads(p.to_json())) == p, f"seed {seed}"
        for i in range(41):
            assert via_json.settings(i) == p.settings(i), f"seed {seed} layer {i}"
    for name in ("bf16", "agoq-paper", "int8", "int4", "int2"):
        assert ActivationPolicy.from_dict(json.loads(preset(name).to_json())) == preset(name)
    sp = stage_aware_policy([11, 9, 7, 5], 9)
    assert ActivationPolicy.from_dict(json.loads(sp.to_json())) == sp


def test_from_dict_rejects_unknown_fields_and_bad_values():
    d = preset("int4").to_dict()
    with pytest.raises(ValueError, match="bits"):
        ActivationPolicy.from_dict({**d, "bits": 4})
    bad = json.loads(json.dumps(d))
    bad["default"]["attention"] = 9
    with pytest.raises(ValueError, match="attention"):
        ActivationPolicy.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["layers"] = {"1": {"silu_input": "recompute"}}
    with pytest.raises(ValueError, match="silu_input"):
        ActivationPolicy.from_dict(bad)


def test_settings_are_checked_where_they_are_read_only(monkeypatch):
    """A plan's settings are checked once, when the plan is read: the policy it gives and the LAAQ layers that
    quantize with it (every kept tensor, every step) check nothing again. A policy from user input and the public
    quantize still refuse a bad bit width."""
    import importlib

    import torch

    import agoq.runtime.activations.policy as policy_module
    import agoq.formats.plan_sections as plan_module  # where the plan's sections check their settings
    from agoq.formats.plan import plan_from_dict
    from agoq.runtime.activations.laaq import apply_activation_policy, observe_kept_tensors
    from agoq.models import build, fingerprint

    quantize_module = importlib.import_module("agoq.runtime.quant.codec")
    seed, rng = fresh_rng()
    calls = {}

    def counted(module, name):
        real = getattr(module, name)

        def check(*args):
            calls[module.__name__, name] = calls.get((module.__name__, name), 0) + 1
            return real(*args)
        monkeypatch.setattr(module, name, check)

    for module, name in [(plan_module, "check_setting"), (plan_module, "check_arguments"),
                         (policy_module, "check_setting"), (policy_module, "check_arguments"),
                         (quantize_module, "check_arguments")]:
        counted(module, name)
    model = build("llama-tiny", seed=seed % 2**31)
    kinds = {k: rng.choice([2, 3, 4, 5, 8]) for k in ("norm_input", "o_proj_input", "silu_input")}
    plan = plan_from_dict({"schema": "agoq.plan/1.1",
                           "model": {"name": "t", "fingerprint": fingerprint(model)},
                           "layers": [{"layer": i, "kinds": kinds} for i in range(3)]})
    assert calls[plan_module.__name__, "check_setting"] == 3 * len(kinds), seed  # read: checked
    calls.clear()
    policy = plan.activation_policy()
    apply_activation_policy(model, policy)
    kept = []
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    with observe_kept_tensors(lambda kind, t, setting: kept.append(setting)):
        model(ids[:, :-1], ids[:, 1:]).backward()
    assert set(kinds.values()) <= set(kept), seed  # quantized at the plan's widths
    assert calls == {}, seed  # and nothing checked again
    with pytest.raises(ValueError, match="bits must be an integer"):
        agoq.quantize(torch.randn(64), 9)
    with pytest.raises(ValueError, match="setting must be a bit width"):
        ActivationPolicy(default={"norm_input": 9})
    assert calls[policy_module.__name__, "check_setting"] > 0
