"""The Plan format: validation with errors naming the field, round trips, and applying a plan to a model
(activation policy and whole-layer checkpointing together) against the runtime's own pieces."""

import json
import random

import pytest
import torch

import agoq
from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.runtime.activations.checkpointing import apply_checkpointing
from agoq.runtime.activations.policy import KINDS, RECOMPUTABLE
from agoq.formats.plan import SCHEMA, Plan, load_plan, plan_from_dict
from agoq.train.apply import apply_plan, remove_plan
from agoq.models import build, fingerprint

B, S = 3, 23


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def random_kinds(rng):
    out = {}
    for kind in KINDS:
        choices = [16, 2, 3, 4, 5, 6, 7, 8] + (["recompute"] if kind in RECOMPUTABLE else [])
        out[kind] = rng.choice(choices)
    return out


def random_plan_dict(rng, num_layers, fp="0123456789abcdef", stages=1):
    # every stage holds a layer, the rest drawn: contiguous runs once sorted
    layer_stage = sorted(list(range(stages)) + [rng.randrange(stages) for _ in range(num_layers - stages)])
    layers = []
    for i in range(num_layers):
        ckpt = rng.random() < 0.3
        layers.append({"layer": i, "stage": layer_stage[i], "checkpoint": ckpt,
                       "kinds": {k: 16 for k in KINDS} if ckpt else random_kinds(rng)})
    return {"schema": SCHEMA, "model": {"name": "m", "fingerprint": fp},
            "budget_bytes": rng.randrange(1, 2**40),
            "activations": {"block": rng.choice([32, 64, 128, 256]), "format": "int",
                            "rounding": rng.choice(["nearest", "stochastic"])},
            "layers": layers,
            "gradients": {"mode": rng.choice(["bf16", "quangrad8", "sdp4bit"]), "block": 256, "bucket_bytes": 1 << 20},
            "pipeline": {"stages": stages, "micro_batches": rng.randrange(1, 9), "schedule": "1f1b"},
            "training": {"micro_batch": 2, "seq_len": 37, "grad_accum": 3},
            "predicted": {"peak_bytes_per_stage": [rng.randrange(10**9) for _ in range(stages)],
                          "activation_bytes_per_stage": [rng.randrange(10**9) for _ in range(stages)],
                          "step_seconds": rng.random(), "grad_error": rng.random()},
            "measured": None,
            "source": {"method": "milp", "objective": "error", "profile": "p", "date": "2026-11-21T00:00:00+00:00"}}


def test_round_trip_and_policy(tmp_path):
    seed, rng = fresh_rng()
    for stages in (1, 3):
        d = random_plan_dict(rng, 7, stages=stages)
        plan = plan_from_dict(d)
        path = plan.save(tmp_path / "plan.json")
        assert [p.name for p in tmp_path.iterdir()] == ["plan.json"], "a temporary file was left behind"
        again = load_plan(path)
        assert again == plan, f"seed {seed}"
        on_disk = json.loads(path.read_text())
        assert on_disk["schema"] == SCHEMA and on_disk["measured"] is None
        for i, lp in enumerate(d["layers"]):
            assert on_disk["layers"][i]["kinds"] == lp["kinds"], f"seed {seed}"
        policy = plan.activation_policy()
        assert (policy.block, policy.format, policy.rounding) == \
            (d["activations"]["block"], "int", d["activations"]["rounding"])
        for i, lp in enumerate(d["layers"]):
            assert policy.settings(i) == lp["kinds"], f"seed {seed} layer {i}"
        assert plan.checkpoint_layers() == [lp["layer"] for lp in d["layers"] if lp["checkpoint"]]


def test_missing_kinds_are_kept_and_unknown_fields_survive(tmp_path):
    d = {"schema": SCHEMA, "model": {"name": "m", "fingerprint": "00000000000000ff"},
         "layers": [{"layer": 0, "kinds": {"silu_input": 5}}, {"layer": 1, "checkpoint": True}],
         "future_field": {"x": 1}}
    plan = plan_from_dict(d)
    assert plan.settings(0) == {**{k: 16 for k in KINDS}, "silu_input": 5}
    assert plan.settings(1) == {k: 16 for k in KINDS}
    path = plan.save(tmp_path / "p.json")
    assert json.loads(path.read_text())["future_field"] == {"x": 1}


def _base():
    return {"schema": SCHEMA, "model": {"name": "m", "fingerprint": "0123456789abcdef"},
            "layers": [{"layer": 0, "kinds": {"norm_input": 4}}, {"layer": 1, "kinds": {"norm_input": 4}}]}


def _set(d, path, value):
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return d


@pytest.mark.parametrize("path,value,field", [
    (("schema",), "agoq.profile/1", "schema"),
    (("schema",), "agoq.plan/2", "schema"),
    (("schema",), "plan", "schema"),
    (("model", "fingerprint"), "xyz", "model.fingerprint"),
    (("budget_bytes",), -5, "budget_bytes"),
    (("budget_bytes",), 0, "budget_bytes"),
    (("layers", 1, "kinds", "silu_input"), 9, "layers[1].kinds"),
    (("layers", 1, "kinds", "silu_input"), 1, "layers[1].kinds"),
    (("layers", 0, "kinds", "attention"), "recompute", "layers[0].kinds"),
    (("layers", 0, "kinds", "norm_input"), True, "layers[0].kinds"),
    (("layers", 0, "kinds", "gate"), 4, "layers[0].kinds"),
    (("layers", 1, "layer"), 5, "layers"),
    (("layers", 1, "stage"), 1, "stage"),
    (("layers", 0, "checkpoint"), True, "layers[0]"),
    (("activations",), {"block": 100}, "activations"),
    (("activations",), {"format": "nf5"}, "activations.format"),
    (("gradients",), {"mode": "int4"}, "gradients.mode"),
    (("pipeline",), {"stages": 0}, "pipeline.stages"),
    (("training",), {"micro_batch": 0}, "training.micro_batch"),
    (("predicted",), {"peak_bytes_per_stage": [1, 2]}, "predicted.peak_bytes_per_stage"),
    (("predicted",), {"step_seconds": -1.0}, "predicted.step_seconds"),
    (("measured",), {"peak_bytes_per_stage": [1, 2, 3]}, "measured.peak_bytes_per_stage"),
    (("host_budget_bytes",), 0, "host_budget_bytes"),
    (("layers", 0, "offload"), "sometimes", "layers[0].offload"),
    (("predicted",), {"host_bytes": -1}, "predicted.host_bytes"),
    (("predicted",), {"offload_link_seconds": -0.5}, "predicted.offload_link_seconds"),
])
def test_invalid_plans_name_the_field(tmp_path, path, value, field):
    d = _set(_base(), path, value)
    (tmp_path / "plan.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        load_plan(tmp_path / "plan.json")
    assert field in str(e.value), str(e.value)
    assert "plan.json" in str(e.value)


def test_missing_schema_file_and_bad_json(tmp_path):
    d = _base()
    del d["schema"]
    (tmp_path / "a.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="schema"):
        load_plan(tmp_path / "a.json")
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "absent.json")
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_plan(tmp_path / "b.json")
    (tmp_path / "c.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_plan(tmp_path / "c.json")


def test_stages_must_be_contiguous_and_all_used():
    d = _base()
    d["pipeline"] = {"stages": 2}
    d["layers"][0]["stage"], d["layers"][1]["stage"] = 1, 0
    with pytest.raises(ValueError, match="contiguous"):
        plan_from_dict(d)
    d["pipeline"] = {"stages": 3}
    d["layers"][0]["stage"], d["layers"][1]["stage"] = 0, 1
    with pytest.raises(ValueError, match="at least one layer"):
        plan_from_dict(d)


def test_plan_for_another_model_refused(tmp_path):
    model = build("llama-tiny")
    other = build("llama-tiny", num_layers=2)
    seed, rng = fresh_rng()
    d = random_plan_dict(rng, model.config.num_hidden_layers, fp=fingerprint(model))
    path = plan_from_dict(d).save(tmp_path / "plan.json")
    assert load_plan(path, model).model.fingerprint == fingerprint(model)
    assert load_plan(path, fingerprint(model)).num_layers == model.config.num_hidden_layers
    with pytest.raises(ValueError, match="model.fingerprint"):
        load_plan(path, other)
    with pytest.raises(ValueError, match="model.fingerprint"):
        plan_from_dict(d).check_model(other)


def _grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _layer_bytes(model, ids, labels):
    with agoq.track_saved_tensors(model) as log:
        loss = model(ids, labels)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return [log.layer_total(i) for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("repeat", range(2))
def test_apply_equals_policy_plus_checkpointing(repeat):
    """apply_plan(the plan's policy and checkpointed layers) == apply_activation_policy(the plan's settings) +
    apply_checkpointing(its layers), on fresh random plans and weights; checkpointed layers keep exactly their
    input, the others what the runtime's byte predictor says; remove_plan gives the plain model back."""
    seed, rng = fresh_rng()
    model = build("llama-tiny", seed=seed % 2**31, num_layers=4)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, model.config.vocab_size, (B, S), generator=g)
    n = model.config.num_hidden_layers
    d = random_plan_dict(rng, n, fp=fingerprint(model))
    d["activations"]["rounding"] = "nearest"  # deterministic, so the two paths can be compared exactly
    d["layers"][rng.randrange(n)].update(checkpoint=True, kinds={k: 16 for k in KINDS})
    plan = plan_from_dict(d)
    loss_plain, g_plain = _grads(model, ids, labels)

    apply_plan(model, policy=plan.activation_policy(), checkpoint=plan.checkpoint_layers())
    # applying again replaces, it does not stack
    apply_plan(model, policy=plan.activation_policy(), checkpoint=plan.checkpoint_layers())
    loss_plan, g_plan = _grads(model, ids, labels)
    measured = _layer_bytes(model, ids, labels)
    remove_plan(model)
    loss_back, g_back = _grads(model, ids, labels)
    assert torch.equal(loss_back, loss_plain)
    for name in g_plain:
        torch.testing.assert_close(g_back[name], g_plain[name], rtol=0, atol=0)

    checkpointed = plan.checkpoint_layers()
    policy = agoq.ActivationPolicy(layers={i: d["layers"][i]["kinds"] for i in range(n) if i not in checkpointed},
                                   block=d["activations"]["block"])
    agoq.apply_activation_policy(model, policy)
    apply_checkpointing(model, checkpointed)
    loss_ref, g_ref = _grads(model, ids, labels)
    remove_plan(model)
    assert torch.equal(loss_plan, loss_ref), f"seed {seed}"
    for name in g_ref:
        torch.testing.assert_close(g_plan[name], g_ref[name], rtol=1e-6, atol=1e-7, msg=f"seed {seed}: {name}")

    shape = LayerShape.from_config(model.config, B, S, elem_bytes=4)
    for i in range(n):
        if i in checkpointed:
            expect = B * S * model.config.hidden_size * 4
        else:
            expect = sum(predict_layer_bytes(shape, plan.settings(i), d["activations"]["block"]).values())
        assert measured[i] == expect, f"seed {seed} layer {i} checkpoint={i in checkpointed}"


def test_checkpoint_only_plan_matches_plain_gradients():
    seed, rng = fresh_rng()
    model = build("llama-tiny", seed=seed % 2**31)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(seed))
    n = model.config.num_hidden_layers
    plan = Plan(model={"name": "t", "fingerprint": fingerprint(model)},
                layers=[{"layer": i, "checkpoint": True} for i in range(n)])
    loss0, g0 = _grads(model, ids, ids)
    apply_plan(model, policy=plan.activation_policy(), checkpoint=plan.checkpoint_layers())
    loss1, g1 = _grads(model, ids, ids)
    remove_plan(model)
    assert torch.equal(loss0, loss1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-7, msg=f"seed {seed}: {name}")


def test_a_1_0_plan_loads_with_the_1_1_defaults():
    """Plans written before 1.1 (no optimizer, compile, decision or alternative) load as eager float32 AdamW, with
    no memory parts (1.2)."""
    rng = random.Random(5)
    data = random_plan_dict(rng, 3)
    data["schema"] = "agoq.plan/1"
    for key in ("optimizer", "decision", "alternative", "alternatives"):
        data.pop(key, None)
    data["training"].pop("compile", None)
    plan = plan_from_dict(data)
    assert SCHEMA == "agoq.plan/1.9"
    assert plan.predicted.memory_per_stage == []
    assert (plan.optimizer.name, plan.optimizer.master, plan.training.compile) == ("adamw", "fp32", "eager")
    assert plan.decision is None and plan.alternative is None and plan.alternatives == []
    assert plan.to_dict()["schema"] == "agoq.plan/1"  # what it was written with is kept


def test_optimizer_and_alternative_fields_are_checked():
    rng = random.Random(6)
    data = random_plan_dict(rng, 2)
    data["optimizer"] = {"name": "adamw", "master": "none"}
    with pytest.raises(ValueError, match="optimizer: .*adamw8bit"):
        plan_from_dict(data)
    data["optimizer"] = {"name": "adamw8bit", "master": "none"}
    data["alternative"] = {"name": "eager full checkpointing, AdamW", "predicted": {"step_seconds": -1.0}}
    with pytest.raises(ValueError, match="alternative.predicted.step_seconds"):
        plan_from_dict(data)
    data["alternative"]["predicted"]["step_seconds"] = 0.123
    data["decision"] = {"objective": "time", "binding": ["memory budget"], "error_cap": 0.4,
                        "error_cap_source": "recipe", "knobs": {"micro_batch": 3}}
    plan = plan_from_dict(data)
    assert plan.alternative.predicted.step_seconds == 0.123 and plan.decision.binding == ["memory budget"]
    data["schema"] = "agoq.plan/2.0"
    with pytest.raises(ValueError, match="newer"):
        plan_from_dict(data)


def test_memory_parts_must_add_up_to_each_stage_peak():
    """predicted.memory_per_stage (1.2): one entry per stage whose parts add up to the stage's predicted peak, the
    checkpointed layer given with checkpoint_backward only; anything else is refused naming the field."""
    seed, rng = fresh_rng()
    data = random_plan_dict(rng, 6, stages=3)
    peaks = data["predicted"]["peak_bytes_per_stage"]
    entries = []
    for s, peak in enumerate(peaks):
        cut = sorted(rng.randrange(peak + 1) for _ in range(3))
        parts = dict(zip(("weights", "optimizer_state", "activations", "head_and_workspace"),
                         [cut[0], cut[1] - cut[0], cut[2] - cut[1], peak - cut[2]]))
        entries.append({"stage": s, "phase": "forward_backward", "parts": parts})
    entries[1].update(phase="checkpoint_backward", layer=3)
    data["predicted"]["memory_per_stage"] = entries
    plan = plan_from_dict(data)
    assert [sum(m.parts.values()) for m in plan.predicted.memory_per_stage] == peaks, seed
    assert plan_from_dict(plan.to_dict()).to_dict() == plan.to_dict()
    bad = json.loads(json.dumps(data))
    bad["predicted"]["memory_per_stage"][2]["parts"]["weights"] += 1
    with pytest.raises(ValueError, match=r"memory_per_stage\[2\].parts: add up to"):
        plan_from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["predicted"]["memory_per_stage"].pop()
    with pytest.raises(ValueError, match="memory_per_stage: one entry per pipeline stage"):
        plan_from_dict(bad)
    bad = json.loads(json.dumps(data))
    del bad["predicted"]["memory_per_stage"][1]["layer"]
    with pytest.raises(ValueError, match=r"memory_per_stage\[1\].layer"):
        plan_from_dict(bad)
    bad = json.loads(json.dumps(data))
    bad["predicted"]["memory_per_stage"][0]["phase"] = "backward"
    with pytest.raises(ValueError, match=r"memory_per_stage\.0\.phase|memory_per_stage\[0\]\.phase"):
        plan_from_dict(bad)


def _offloading_plan(rng, stages=1):
    """A random 1.4 plan offloading a random non-empty set of layers (checkpointed ones included)."""
    data = random_plan_dict(rng, 7, stages=stages)
    offloaded = sorted(rng.sample(range(7), rng.randrange(1, 8)))
    for lp in data["layers"]:
        lp["offload"] = lp["layer"] in offloaded
    data["host_budget_bytes"] = rng.randrange(1, 2**40)
    data["predicted"].update(host_bytes=rng.randrange(data["host_budget_bytes"] + 1),
                             offload_link_seconds=rng.random())
    return data, offloaded


def test_a_1_4_plan_with_offloaded_layers_round_trips(tmp_path):
    """layers[*].offload, host_budget_bytes, predicted.host_bytes and offload_link_seconds are written and read back;
    offload_layers() lists the offloaded layers in order, checkpointed ones too."""
    seed, rng = fresh_rng()
    data, offloaded = _offloading_plan(rng)
    assert data["schema"] == SCHEMA == "agoq.plan/1.9"
    plan = plan_from_dict(data)
    assert plan.offload_layers() == offloaded, seed
    path = plan.save(tmp_path / "plan.json")
    again = load_plan(path)
    assert again == plan and again.offload_layers() == offloaded, seed
    on_disk = json.loads(path.read_text())
    assert [lp["offload"] for lp in on_disk["layers"]] == [i in offloaded for i in range(7)]
    assert on_disk["host_budget_bytes"] == data["host_budget_bytes"]
    assert on_disk["predicted"]["host_bytes"] == data["predicted"]["host_bytes"]
    assert on_disk["predicted"]["offload_link_seconds"] == data["predicted"]["offload_link_seconds"]
    assert again.checkpoint_layers() == [lp["layer"] for lp in data["layers"] if lp["checkpoint"]]
    # offload does not change the activation policy: a checkpointed offloaded layer is still all 16
    for i, lp in enumerate(data["layers"]):
        assert again.activation_policy().settings(i) == lp["kinds"], f"seed {seed} layer {i}"
    # a replicated launch offloads; agoq's retired own sharded one is refused, saying what to run instead
    for parallel in ("none", "ddp"):
        plan_from_dict({**data, "launch": {"processes": 2, "parallel": parallel}})
    with pytest.raises(ValueError, match="own sharded path.*retired.*--parallel fsdp --gradients sdp4bit"):
        plan_from_dict({**data, "launch": {"processes": 2, "parallel": "sharded"}})


def test_a_1_3_plan_loads_unchanged_offloading_nothing(tmp_path):
    rng = random.Random(13)
    data = random_plan_dict(rng, 4)
    data["schema"] = "agoq.plan/1.3"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    assert [lp.offload for lp in plan.layers] == [False] * 4 and plan.offload_layers() == []
    assert plan.host_budget_bytes is None
    assert (plan.predicted.host_bytes, plan.predicted.offload_link_seconds) == (None, None)
    assert plan.to_dict()["schema"] == "agoq.plan/1.3"  # what it was written with is kept
    assert plan_from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("change,said", [
    (dict(stages=2), r"layers\[\*\]\.offload: layer\(s\) \[.*\] are offloaded in a pipeline of 2 stages.*offload no "
                     r"layer, or make the plan for one stage"),
    (dict(launch="fsdp"), r"layers\[\*\]\.offload: .* parallel mode is 'fsdp'.*offload no layer, or launch"),
    # a 2-process pipeline launch of a one-stage plan: its dims (2 stages) contradict pipeline.stages
    (dict(launch="pipeline"), r"parallel\.pipeline: 2 stage\(s\), pipeline\.stages says 1"),
    (dict(host="over"), r"predicted\.host_bytes: the offloaded layers hold \d+ bytes .* more than the plan's "
                        r"host_budget_bytes \(\d+\): offload fewer layers"),
])
def test_offload_where_the_runtime_cannot_is_refused(tmp_path, change, said):
    """Offloaded layers in a pipeline, under an fsdp or pipeline launch, or predicted to hold more host memory than
    the plan's host budget: refused naming the field and what to do. Without offloaded layers the same plan loads."""
    seed, rng = fresh_rng()
    data, _ = _offloading_plan(rng, stages=change.get("stages", 1))
    if "launch" in change:
        data["launch"] = {"processes": 2, "parallel": change["launch"]}
    if "host" in change:
        data["predicted"]["host_bytes"] = data["host_budget_bytes"] + 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=said) as e:
        load_plan(path)
    assert "plan.json" in str(e.value), seed
    if "host" not in change and change.get("launch") != "pipeline":  # (a pipeline launch needs its stages too)
        for lp in data["layers"]:
            lp["offload"] = False
        assert plan_from_dict(data).offload_layers() == []
    # either figure alone holds nothing to compare
    if "host" in change:
        plan_from_dict({**data, "host_budget_bytes": None})


def test_new_plan_is_plan_from_dict_in_this_schema():
    """new_plan (how agoq's stages make a plan) equals plan_from_dict of the same sections stamped with this schema,
    whatever schema the sections came from; what it refuses it names, with `where`."""
    from agoq.formats.plan import new_plan

    seed, rng = fresh_rng()
    data = random_plan_dict(rng, rng.randrange(2, 9), stages=rng.choice([1, 2]))
    data["schema"] = "agoq.plan/1.0"
    sections = {k: v for k, v in data.items() if k not in ("schema", "model", "layers")}
    made = new_plan(data["model"], data["layers"], **sections)
    assert made.schema_ == SCHEMA, seed
    assert made.to_dict() == plan_from_dict({**data, "schema": SCHEMA}).to_dict(), seed
    with pytest.raises(ValueError, match=r"^made here: invalid plan: optimizer: master 'none'"):
        new_plan(data["model"], data["layers"], "made here", optimizer={"name": "adamw", "master": "none"})
