"""`agoq train --plan` runs what the plan records: optimizer, masters, compile mode, micro-batch x accumulation,
gradient storage, activation bits, checkpointed and offloaded layers (and the host budget) are the flags' defaults;
a flag that contradicts the plan is refused (exit 2) naming both values; 1.0 plans train with today's defaults;
policy runs record the optimizer and masters they used."""

import json
from pathlib import Path

import pytest

from agoq.cli import main
from agoq.formats.plan import Plan, load_plan, plan_from_dict
from agoq.models import build, fingerprint

LAYERS = 3  # llama-tiny


def _run_json(run_dir):
    return json.loads(Path(run_dir, "run.json").read_text())


def _plan(tmp_path, schema="agoq.plan/1.1", name="plan.json", **sections) -> Path:
    """A plan for llama-tiny: layer 1 checkpointed, the others at 4/5 bits or recomputed; micro-batch 3 x
    accumulation 2 of 23 tokens, quangrad8, and whatever `sections` add (written as given: nothing filled in)."""
    model = build("llama-tiny")
    layers = [{"layer": i, "stage": 0, "checkpoint": i == 1,
               "kinds": {} if i == 1 else {"norm_input": 4, "qkv_input": "recompute", "silu_input": 5}}
              for i in range(LAYERS)]
    data = {"schema": schema, "model": {"name": model.config.name, "fingerprint": fingerprint(model)},
            "layers": layers, "gradients": {"mode": "quangrad8"},
            "training": {"micro_batch": 3, "seq_len": 23, "grad_accum": 2}}
    for key, value in sections.items():
        if key == "training":
            data["training"] = {**data["training"], **value}
        else:
            data[key] = value
    plan_from_dict(data)  # valid
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _searched_plan(tmp_path):
    return _plan(tmp_path, optimizer={"name": "adamw8bit", "master": "none"}, training={"compile": "compiled"})


@pytest.fixture
def compile_calls(monkeypatch):
    """Counts the layers the trainer compiles; compiles with aot_eager (Inductor's cold CPU compile of each layer
    would take most of a minute here: the same graphs, traced the same way)."""
    import agoq.runtime.activations.compile as compile_module
    from agoq.train import apply

    calls = []
    real = compile_module.compile_decoder_layers

    def aot_eager_layers(model, mode=None, **options):
        calls.append((real(model, mode=mode, backend="aot_eager"), mode))
        return calls[-1][0]

    monkeypatch.setattr(apply, "compile_decoder_layers", aot_eager_layers)
    return calls


def _train(plan, out, *flags):
    return main(["train", "llama-tiny", "--plan", str(plan), "--steps", "3", "--eval-batches", "1",
                 "--checkpoint-every", "0", "--dtype", "bf16", "--quiet", "--out", str(out), *flags])


def test_a_searched_plan_trains_with_everything_it_records(tmp_path, compile_calls, monkeypatch):
    from agoq.train import preparation

    applied = []
    real_prepare = preparation.prepare

    def spy(cfg, world):  # the model as prepare hands it over: the plan's checkpointing and policy in place
        prepared = real_prepare(cfg, world)
        from agoq.runtime.activations.saved_bytes import find_decoder_layers

        layers = find_decoder_layers(prepared.model)
        applied.append([getattr(layer, "_agoq_checkpointed", False) for layer in layers])
        applied.append(prepared.model._agoq_policy.settings(0)["silu_input"])
        return prepared

    from agoq.train import trainer

    monkeypatch.setattr(trainer, "prepare", spy)
    plan = _searched_plan(tmp_path)
    out = tmp_path / "run"
    assert _train(plan, out) == 0
    run = _run_json(out)
    s = run["settings"]
    assert run["status"] == "finished"
    assert (s["optimizer"], s["master"], s["gradients"]) == ("adamw8bit", "none", "quangrad8")
    assert (s["compile"], s["compile_mode"]) == (True, "default")
    assert (s["micro_batch"], s["grad_accum"], s["seq_len"]) == (3, 2, 23)
    assert s["tokens_per_step"] == 3 * 2 * 23 and s["policy"] == "plan:plan.json"
    assert run["plan"]["optimizer"] == {"name": "adamw8bit", "master": "none"}
    assert run["plan"]["training"]["compile"] == "compiled"
    assert compile_calls == [(LAYERS, "default")]
    assert applied == [[False, True, False], 5]  # layer 1 checkpointed; layer 0's silu_input at 5 bits


@pytest.mark.parametrize("flags, said", [
    (["--optimizer", "adamw"], "--optimizer adamw contradicts the plan's optimizer.name adamw8bit"),
    (["--master", "fp32"], "--master fp32 contradicts the plan's optimizer.master none"),
    (["--no-compile"], "--no-compile contradicts the plan's training.compile compiled"),
    (["--compile-mode", "max-autotune-no-cudagraphs"],
     "--compile-mode max-autotune-no-cudagraphs contradicts the plan's compile mode 'default'"),
    (["--micro-batch", "5"], "--micro-batch 5 contradicts the plan's training.micro_batch 3"),
    (["--grad-accum", "7"], "--grad-accum 7 contradicts the plan's training.grad_accum 2"),
    (["--gradients", "bf16"], "--gradients bf16 contradicts the plan's gradients.mode quangrad8"),
    (["--checkpoint-all"], "--checkpoint-all contradicts the plan's checkpointed layers [1] of 3"),
])
def test_a_flag_that_contradicts_the_plan_is_refused(tmp_path, capsys, flags, said):
    out = tmp_path / "never"
    assert _train(_searched_plan(tmp_path), out, *flags) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "drop that flag" in err and "re-run `agoq search`" in err and str(tmp_path / "plan.json") in err
    assert not (out / "run.json").exists()


def test_every_contradiction_is_named_at_once(tmp_path, capsys):
    assert _train(_searched_plan(tmp_path), tmp_path / "never", "--optimizer", "adamw", "--micro-batch", "4") == 2
    err = capsys.readouterr().err
    assert "--optimizer adamw contradicts" in err and "--micro-batch 4 contradicts" in err
    assert "drop those flags" in err


def test_flags_equal_to_the_plan_are_accepted(tmp_path, compile_calls):
    out = tmp_path / "run"
    assert _train(_searched_plan(tmp_path), out, "--optimizer", "adamw8bit", "--master", "none", "--compile",
                  "--micro-batch", "3", "--grad-accum", "2", "--gradients", "quangrad8") == 0
    s = _run_json(out)["settings"]
    assert (s["optimizer"], s["master"], s["compile"], s["micro_batch"], s["grad_accum"]) == (
        "adamw8bit", "none", True, 3, 2)


def test_a_plan_checkpointing_every_layer_takes_checkpoint_all(tmp_path):
    path = _plan(tmp_path, layers=[{"layer": i, "checkpoint": True} for i in range(LAYERS)],
                 model={"name": "llama-tiny", "fingerprint": fingerprint(build("llama-tiny"))})
    assert _train(path, tmp_path / "run", "--checkpoint-all") == 0


def test_an_eager_plan_refuses_compile(tmp_path, capsys):
    path = _plan(tmp_path, training={"compile": "eager"})
    assert _train(path, tmp_path / "never", "--compile") == 2
    err = capsys.readouterr().err
    assert "--compile contradicts the plan's training.compile eager" in err
    assert "compile mode" not in err  # said once, by the compile flag


@pytest.mark.parametrize("schema", ["agoq.plan/1", "agoq.plan/1.0"])
def test_a_1_0_plan_trains_with_todays_defaults(tmp_path, schema):
    path = _plan(tmp_path, schema=schema)
    out = tmp_path / "run"
    assert _train(path, out) == 0
    run = _run_json(out)
    s = run["settings"]
    assert (s["optimizer"], s["master"], s["compile"], s["gradients"]) == ("adamw", "fp32", False, "quangrad8")
    assert (s["micro_batch"], s["grad_accum"], s["seq_len"]) == (3, 2, 23)
    assert run["plan"]["schema"] == schema and run["plan"]["optimizer"] == {"name": "adamw", "master": "fp32"}
    # it records no optimizer, so the flag decides it (as before 1.1), and run.json says what ran
    out = tmp_path / "run8"
    assert _train(path, out, "--optimizer", "adamw8bit", "--master", "none") == 0
    run = _run_json(out)
    assert (run["settings"]["optimizer"], run["settings"]["master"]) == ("adamw8bit", "none")
    assert run["plan"]["optimizer"] == {"name": "adamw8bit", "master": "none"}
    # a 1.0 plan written back with every default filled in still states nothing about the optimizer
    resaved = load_plan(path)
    resaved.save(path)
    assert "optimizer" in json.loads(path.read_text())
    assert load_plan(path).states_run_settings() == {"optimizer": False, "compile": False}


def test_a_1_1_plan_without_the_sections_states_nothing(tmp_path):
    assert load_plan(_plan(tmp_path)).states_run_settings() == {"optimizer": False, "compile": False}
    assert load_plan(_searched_plan(tmp_path)).states_run_settings() == {"optimizer": True, "compile": True}


def test_a_policy_run_records_the_optimizer_and_masters_it_used(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "llama-tiny", "--policy", "agoq-paper", "--optimizer", "adamw8bit", "--master", "none",
                 "--gradients", "quangrad8", "--dtype", "bf16", "--seq-len", "19", "--micro-batch", "3",
                 "--grad-accum", "2", "--steps", "2", "--eval-batches", "1", "--checkpoint-every", "0", "--quiet",
                 "--out", str(out)]) == 0
    run = _run_json(out)
    recorded = plan_from_dict(run["plan"])
    assert (recorded.optimizer.name, recorded.optimizer.master) == ("adamw8bit", "none")
    assert recorded.training.compile == "eager" and recorded.states_run_settings() == {"optimizer": True,
                                                                                        "compile": True}
    assert (recorded.training.micro_batch, recorded.training.grad_accum, recorded.training.seq_len) == (3, 2, 19)
    # the recorded plan trains the same run again, with the same optimizer and masters
    plan_path = tmp_path / "recorded.json"
    Plan.model_validate(run["plan"]).save(plan_path)
    again = tmp_path / "again"
    assert _train(plan_path, again) == 0
    s = _run_json(again)["settings"]
    assert (s["optimizer"], s["master"], s["gradients"], s["micro_batch"]) == ("adamw8bit", "none", "quangrad8", 3)


def test_plan_for_policy_writes_the_optimizer_given():
    from agoq.runtime.activations.policy import as_policy
    from agoq.train.plan_settings import plan_for_policy

    model = build("llama-tiny")
    data = plan_for_policy(as_policy("agoq-paper"), model, "bf16", 3, 19, 2, None, 1, optimizer="adamw8bit",
                           master="fp32", compile=True)
    plan = plan_from_dict(data)
    assert (plan.optimizer.name, plan.optimizer.master, plan.training.compile) == ("adamw8bit", "fp32", "compiled")
    default = plan_from_dict(plan_for_policy(as_policy("agoq-paper"), model, "bf16", 3, 19, 2, None, 1))
    assert (default.optimizer.name, default.optimizer.master, default.training.compile) == ("adamw", "fp32", "eager")


def test_the_plans_launch_decides_the_parallel_mode_under_torchrun(tmp_path):
    """Under torchrun an fsdp or pipeline launch is --parallel's default; one process keeps the usual default
    (and the refusal that says how to launch); an explicit mode of another kind is refused."""
    from agoq.train.parallel import World
    from agoq.layout import plan_parallel_default
    from agoq.train.plan_settings import check_flags_against_plan, plan_settings

    sharded = load_plan(_plan(tmp_path, gradients={"mode": "sdp4bit"}, launch={"processes": 3, "parallel": "fsdp"}))
    assert plan_parallel_default(sharded, World(size=3)) == "fsdp"
    assert plan_parallel_default(sharded, World()) is None
    replicated = load_plan(_plan(tmp_path, name="ddp.json", launch={"processes": 3, "parallel": "ddp"}))
    assert plan_parallel_default(replicated, World(size=3)) is None  # ddp is the default under torchrun anyway
    decided = plan_settings(sharded, "fsdp")
    check_flags_against_plan({"parallel": "fsdp"}, decided, sharded, "p.json")
    with pytest.raises(ValueError,
                       match=r"--parallel ddp contradicts the plan's parallel fsdp \(shard 3 \(fsdp2\): 3 "
                             r"process"):
        check_flags_against_plan({"parallel": "ddp"}, decided, sharded, "p.json")
    check_flags_against_plan({"parallel": "none"}, plan_settings(replicated, "ddp"), replicated, "p.json")
    check_flags_against_plan({"parallel": "fsdp"}, plan_settings(load_plan(_plan(tmp_path, name="old.json")), "fsdp"),
                             sharded, "p.json")  # no launch: nothing decided


def test_compile_defaults_to_the_device_and_mode_unless_a_flag_or_plan_says():
    """No flag and no plan: compiled exactly on CUDA in one process or DDP; a plan's or a flag's value wins."""
    import torch

    from agoq.train.config import TrainConfig
    from agoq.train.plan_settings import compile_by_default, resolve_settings

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for device, mode, want in [(cuda, "none", True), (cuda, "ddp", True), (cuda, "fsdp", False),
                               (cuda, "hsdp", False), (cuda, "pipeline", False), (cpu, "none", False),
                               (cpu, "ddp", False)]:
        assert compile_by_default(device, mode) is want, (device, mode)
    base = TrainConfig(model="llama-tiny", data="d.txt")
    flagged = TrainConfig(model="llama-tiny", data="d.txt", compile=False)
    for default in (True, False):
        assert resolve_settings(base, {}, base.parallelism, compile_default=default).model.compile is default
        assert resolve_settings(base, {"compile": None}, base.parallelism,
                                compile_default=default).model.compile is default  # a plan that does not say
        assert resolve_settings(base, {"compile": not default}, base.parallelism,
                                compile_default=default).model.compile is (not default)
        assert resolve_settings(flagged, {}, flagged.parallelism, compile_default=default).model.compile is False


def _offloading_plan(tmp_path, offloaded=(0, 1), name="plan.json", **sections) -> Path:
    """`_plan` (layer 1 checkpointed) with `offloaded` layers and a host budget, at a batch whose saved tensors pass
    offload's 64 KiB floor (micro-batch 4 x 131 tokens: agoq.runtime.activations.offload.MIN_BYTES)."""
    layers = [{"layer": i, "stage": 0, "checkpoint": i == 1, "offload": i in offloaded,
               "kinds": {} if i == 1 else {"norm_input": 4, "qkv_input": "recompute", "silu_input": 5}}
              for i in range(LAYERS)]
    sections = {"schema": "agoq.plan/1.5", "layers": layers, "host_budget_bytes": 2_345_678_901,
                "predicted": {"host_bytes": 1_000_000, "offload_link_seconds": 0.01},
                "training": {"micro_batch": 4, "seq_len": 131, "grad_accum": 2}, **sections}
    return _plan(tmp_path, name=name, **sections)


@pytest.fixture
def applied_offload(monkeypatch):
    """What prepare hands apply_plan: the offloaded layers and their host budget in bytes, one entry per run."""
    from agoq.train import preparation

    seen = []
    real = preparation.apply_plan

    def spy(model, **kwargs):
        run = kwargs["run"]  # the RunSpec apply_plan receives: its offload in layer indices and bytes
        seen.append((list(run.offload.layers), run.offload.host_budget_bytes))
        return real(model, **kwargs)

    monkeypatch.setattr(preparation, "apply_plan", spy)
    return seen


def test_a_plan_offloading_layers_trains_with_them(tmp_path, applied_offload):
    """A 1.4 plan's offloaded layers are the run's offload and its host_budget_bytes the run's host budget, to the
    byte; run.json records both in its settings, what moved, and the plan's layers as offloaded."""
    out = tmp_path / "run"
    assert _train(_offloading_plan(tmp_path), out) == 0
    assert applied_offload == [([0, 1], 2_345_678_901)]
    run = _run_json(out)
    assert run["status"] == "finished"
    assert run["settings"]["offload"] == [0, 1] and run["settings"]["host_budget_gb"] == 2.345678901
    assert [lp["offload"] for lp in run["plan"]["layers"]] == [True, True, False]
    assert run["plan"]["host_budget_bytes"] == 2_345_678_901
    moved = run["offload"]
    assert moved["offloaded_bytes"] > 0 and set(moved["bytes_per_layer"]) == {"0", "1"}
    # --host-budget bounds the plan's offload in its place; --offload naming the plan's layers is accepted
    out = tmp_path / "budget"
    assert _train(_offloading_plan(tmp_path), out, "--host-budget", "0.5", "--offload", "1,0") == 0
    assert applied_offload[-1] == ([0, 1], 500_000_000)
    s = _run_json(out)["settings"]
    assert s["offload"] == [0, 1] and s["host_budget_gb"] == 0.5


def test_a_plan_offloading_nothing_runs_no_offload(tmp_path, applied_offload):
    out = tmp_path / "run"
    assert _train(_plan(tmp_path, schema="agoq.plan/1.3"), out, "--offload", "none") == 0
    assert applied_offload == [([], None)]
    assert _run_json(out)["settings"]["offload"] == []


@pytest.mark.parametrize("offloaded, flags, said", [
    ((0, 1), ["--offload", "0"],
     "--offload 0 contradicts the plan's offloaded layers 0-1 of 3 (layers[*].offload)"),
    ((0, 1), ["--offload", "none"], "--offload none contradicts the plan's offloaded layers 0-1 of 3"),
    ((), ["--offload", "all"],
     "--offload all contradicts the plan's no offloaded layer of 3 (it was priced with every layer's tensors on the "
     "device)"),
])
def test_offload_flags_that_contradict_the_plan_are_refused(tmp_path, capsys, offloaded, flags, said):
    out = tmp_path / "never"
    assert _train(_offloading_plan(tmp_path, offloaded=offloaded), out, *flags) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "drop that flag" in err and "re-run `agoq search`" in err and str(tmp_path / "plan.json") in err
    assert not (out / "run.json").exists()


def test_a_host_budget_for_a_plan_that_offloads_nothing_is_refused(tmp_path, capsys):
    out = tmp_path / "never"
    assert _train(_offloading_plan(tmp_path, offloaded=()), out, "--host-budget", "2") == 2
    err = capsys.readouterr().err
    assert "--host-budget bounds offload's host memory, and the plan offloads no layer" in err, err
    assert not (out / "run.json").exists()


def test_offload_is_decided_as_layers():
    """plan_settings gives the offloaded layers; --offload counts as the layers it names, however written; the run's
    offload is the flag's layers, else the plan's list as it is, and its host budget the flag's bytes, else the
    plan's host_budget_bytes."""
    from agoq.train.config import TrainConfig
    from agoq.train.plan_settings import Offload, check_flags_against_plan, plan_settings, resolve_offload

    model = build("llama-tiny", num_layers=12)
    layers = [{"layer": i, "offload": i in (0, 1, 2, 3, 4, 5, 8)} for i in range(12)]
    plan = plan_from_dict({"schema": "agoq.plan/1.5", "host_budget_bytes": 123_456_789_012,
                           "model": {"name": "m", "fingerprint": fingerprint(model)}, "layers": layers})
    decided = plan_settings(plan, "none")
    assert decided["offload"] == [0, 1, 2, 3, 4, 5, 8] and decided["host_budget_bytes"] == 123_456_789_012
    for same in ("0-5,8", "8,0-5", " 0,1,2,3,4,5,8 ", "0-3,2-5,8"):
        check_flags_against_plan({"offload": same}, decided, plan, "p.json")
    for other in ("0-5", "all", "all-but-last", "none"):
        with pytest.raises(ValueError, match=f"--offload {other} contradicts"):
            check_flags_against_plan({"offload": other}, decided, plan, "p.json")
    with pytest.raises(ValueError, match="out of range"):
        check_flags_against_plan({"offload": "0-12"}, decided, plan, "p.json")
    base = TrainConfig(model="llama-tiny", plan=plan)
    assert resolve_offload(base, decided, plan) == Offload((0, 1, 2, 3, 4, 5, 8), 123_456_789_012, from_plan=True)
    flagged = TrainConfig(model="llama-tiny", plan=plan, offload="8,0-5", host_budget=7_500_000_001)
    assert resolve_offload(flagged, decided, plan) == Offload((0, 1, 2, 3, 4, 5, 8), 7_500_000_001)
    named = TrainConfig(model="llama-tiny", plan=plan, offload="0-5,8")  # the plan's layers named: its budget too
    assert resolve_offload(named, decided, plan).host_budget_bytes == 123_456_789_012
    assert resolve_offload(TrainConfig(model="llama-tiny"), {}) == Offload()  # no plan: the flags decide
    alone = TrainConfig(model="llama-tiny", offload="all-but-last", host_budget=1)  # llama-tiny: 3 layers
    assert resolve_offload(alone, {}) == Offload((0, 1), 1)
    with pytest.raises(ValueError, match="out of range"):
        resolve_offload(TrainConfig(model="llama-tiny", offload="3"), {})


def test_a_plans_offload_reaches_the_run_unchanged(tmp_path, applied_offload):
    """A plan with random, non-contiguous offloaded layers and a host budget of no round number of bytes: the run's
    spec (reconcile) holds exactly those layers (ints) and bytes (an int); trained through `agoq train`, apply_plan
    receives them and run.json records them. No flag text or GB is made of them on the way."""
    import random

    import torch

    from agoq.train.config import TrainConfig
    from agoq.train.parallel import World
    from agoq.train.plan_settings import reconcile

    rng = random.Random(4417)
    for _ in range(5):  # many layers: a plan is reconciled without building its model
        n = rng.randrange(8, 40)
        chosen = sorted(rng.sample(range(n), rng.randrange(2, n // 2)))
        if chosen[-1] - chosen[0] + 1 == len(chosen):  # one run of layers: make a gap
            chosen = chosen[:-1] + [min(n - 1, chosen[-1] + 2)]
        budget = rng.randrange(10**9, 10**13)
        plan = plan_from_dict({"schema": "agoq.plan/1.5", "host_budget_bytes": budget,
                               "model": {"name": "m", "fingerprint": "0123456789abcdef"},
                               "layers": [{"layer": i, "offload": i in chosen} for i in range(n)]})
        spec = reconcile(TrainConfig(model="llama-tiny", plan=plan), plan, "p.json", World(), torch.device("cpu"))
        assert spec.offload.layers == tuple(chosen) and all(type(i) is int for i in spec.offload.layers)
        assert spec.offload.host_budget_bytes == budget and type(spec.offload.host_budget_bytes) is int
    # end to end on llama-tiny (3 layers: 0 and 2 are the non-contiguous choice)
    budget = rng.randrange(10**9, 10**12)
    path = _offloading_plan(tmp_path, offloaded=(0, 2), host_budget_bytes=budget)
    out = tmp_path / "run"
    assert _train(path, out) == 0
    (seen_layers, seen_budget), = applied_offload
    assert seen_layers == [0, 2] and all(type(i) is int for i in seen_layers)
    assert seen_budget == budget and type(seen_budget) is int
    settings = _run_json(out)["settings"]
    assert settings["offload"] == [0, 2] and round(settings["host_budget_gb"] * 1e9) == budget
    # --host-budget in GB or with a unit reaches the run as bytes, read once
    for flag, expected in (("0.731", 731_000_000), ("1.5GiB", 3 * 2**29)):
        assert _train(path, tmp_path / flag, "--host-budget", flag) == 0
        assert applied_offload[-1] == ([0, 2], expected)
