"""The cluster's configurations: FSDP2 with compile's activation_memory_budget priced from the measured budget step,
agoq's FSDP2 of TLq-HS gradients with its int8 weight gather as a configuration the search picks and `agoq train
--plan` runs, and every plan and alternative of a search training the requested global batch in the layout asked."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from agoq.formats.plan import plan_from_dict
from agoq.formats.profile import load_profile
from agoq.search.alternatives import price_alternatives
from agoq.search.costs import build_problem
from agoq.search.knobs import combinations
from agoq.search.price import Configuration, plan_layout, price
from agoq.search.problem import ProblemSettings
from agoq.search.request import InfeasibleBudget, knob_space
from agoq.search.search import plan_from_profile
from tests.multiprocess import run_workers
from tests.search.synthetic_profile import write_profile


def _profile(tmp_path, rng, budgets=True, layout_rows=None):
    """A 3-layer llama-tiny profile over 2 ranks with FSDP2's collectives, measured steps with peaks, and compiled
    steps under activation_memory_budget 0.5 / 0.3 at micro-batch 2 x 1 and 1 x 2."""
    folder = write_profile(tmp_path / "p", rng, num_layers=3, micro_batch=2, seq_len=31, world_size=2,
                           collectives=True, fsdp_collectives=True, link_bytes_per_second=rng.uniform(3e8, 3e9),
                           layer_forward=True, compile_modes=("eager", "compiled"), step_peaks=True,
                           optimizer_step_bytes=rng.randrange(10**5, 10**6))
    header = json.loads((folder / "profile.json").read_text())
    rows = header["measured_steps"]["rows"]
    if budgets:
        for mb, accum in ((2, 1), (1, 2)):
            bf16 = next(r for r in rows if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"],
                                            r["gradients"], r["optimizer"], r["master"])
                        == ("compiled", "bf16", mb, accum, "bf16", "adamw8bit", "fp32"))
            bf16["peak_bytes"] = rng.randrange(2 * 10**7, 3 * 10**7)
            for b in (0.5, 0.3):
                rows.append({**bf16, "activation_memory_budget": b,
                             "step_seconds": bf16["step_seconds"] * rng.uniform(1.02, 1.2),
                             "peak_bytes": bf16["peak_bytes"] - rng.randrange(10**5, 10**7)})
    if layout_rows is not None:
        header["layout_steps"] = {"version": 1, "world_size": 2, "rows": layout_rows}
    (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder)


def _row(profile, mb, accum, budget):
    return next(r for r in profile.header["measured_steps"]["rows"]
                if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"], r["optimizer"],
                    r["master"], r["activation_memory_budget"])
                == ("compiled", "bf16", mb, accum, "bf16", "adamw8bit", "fp32", budget))


def test_fsdp2_under_compiles_budget_is_its_kept_step_moved_by_what_the_budget_measured(tmp_path, seed):
    rng = random.Random(seed)
    profile = _profile(tmp_path, rng)
    alts = price_alternatives(profile, 10**15, [(2, 1), (1, 2)], ["compiled"], layouts=("replicated", "fsdp"),
                              masters=("fp32",))
    fsdp_budget = [a for a in alts if a.layout == "fsdp" and a.activation_memory_budget is not None]
    assert {(a.micro_batch, a.activation_memory_budget) for a in fsdp_budget} == {(2, 0.5), (2, 0.3), (1, 0.5),
                                                                                   (1, 0.3)}, seed
    assert all(a.name.startswith("FSDP2 compiled activation_memory_budget") for a in fsdp_budget)
    for a in fsdp_budget:
        knobs = ProblemSettings(gradient_mode="bf16", optimizer=a.optimizer, master=a.master, compile_mode="compiled",
                                micro_batch=a.micro_batch, grad_accum=a.grad_accum, layout="fsdp")
        kept = price(profile, Configuration(knobs))  # FSDP2 with every layer kept
        budget_row, plain = _row(profile, a.micro_batch, a.grad_accum, a.activation_memory_budget), \
            _row(profile, a.micro_batch, a.grad_accum, None)
        floor = build_problem(profile, knobs).peak_floor().max()
        step = kept.step_seconds + (budget_row["step_seconds"] - plain["step_seconds"])
        saved = max(budget_row["peak_bytes"] - plain["peak_bytes"], -kept.activation_bytes_per_stage[0])
        peak = max(kept.peak_bytes + saved, floor)
        assert a.step_seconds == pytest.approx(step, rel=1e-9), (seed, a.name)
        assert abs(a.peak_bytes - peak) <= 2, (seed, a.name)
        assert a.communication_seconds == pytest.approx(kept.communication_seconds, rel=1e-12)
        assert a.step_seconds > kept.step_seconds  # its recompute is paid


def _layout_row(layout, gradients, gather, seconds):
    return {"layout": layout, "gradients": gradients, "weight_gather": gather, "compile": "eager", "micro_batch": 2,
            "grad_accum": 1, "optimizer": "adamw8bit", "master": "fp32", "steps": 6, "step_seconds": seconds,
            "peak_bytes": None}


def test_the_search_picks_fsdp2_with_agoqs_int8_gather_and_train_runs_it(tmp_path, seed):
    from agoq.train.config import TrainConfig
    from agoq.train.parallel import World
    from agoq.train.plan_settings import reconcile

    rng = random.Random(seed)
    plain = _profile(tmp_path, rng, budgets=False)
    assert {k.weight_gather for k in combinations(plain, knob_space(layout="fsdp", gradients="sdp4bit"))} \
        == {"bf16", "int8", "int4"}
    assert {k.weight_gather for k in combinations(plain, knob_space(layout="fsdp", gradients="bf16"))} == {"bf16"}
    fast = price(plain, Configuration(ProblemSettings(layout="fsdp", gradient_mode="sdp4bit", micro_batch=2)))
    compute = fast.step_seconds - fast.communication_seconds
    # measured: the int8 gather hides almost all of FSDP2's communication, its bf16 gather does not, and the int4
    # one (the fewest bytes) was measured slower here: the measured step, not the bytes, decides
    rows = [_layout_row("fsdp", "sdp4bit", "int8", compute * 1.01), _layout_row("fsdp", "sdp4bit", "bf16", compute * 3),
            _layout_row("fsdp", "sdp4bit", "int4", compute * 2)]
    json_rows = json.loads(json.dumps(rows))
    profile = _profile(tmp_path / "again", random.Random(seed), budgets=False, layout_rows=json_rows)
    plan = plan_from_profile(profile, 10**15, error_cap=None, space=knob_space(layout="fsdp", gradients="sdp4bit",
                                                                               compile="eager"))
    data = plan.to_dict()
    assert data["parallel"]["weight_gather"] == "int8" and data["parallel"]["engine"] == "fsdp2", seed
    assert data["launch"]["command"].endswith("--parallel fsdp --gradients sdp4bit --weight-gather int8"), seed
    assert plan.decision.knobs["weight_gather"] == "int8" and plan_layout(plan) == "fsdp"
    again = plan_from_dict(json.loads(json.dumps(data)))
    config = Configuration.of_plan(again)
    assert config.knobs.weight_gather == "int8"
    assert price(profile, config).step_seconds == pytest.approx(plan.predicted.step_seconds, rel=1e-9)
    # agoq train --plan takes the gather from the plan, and refuses another one
    spec = reconcile(TrainConfig(model="llama-tiny", device="cpu"), again, "plan.json", World(0, 2, 0, 2),
                     __import__("torch").device("cpu"))
    assert spec.cfg.parallelism.weight_gather == "int8" and spec.layout.mode == "fsdp"
    with pytest.raises(ValueError, match="--weight-gather int4 contradicts the plan's parallel.weight_gather int8"):
        reconcile(TrainConfig(model="llama-tiny", device="cpu", weight_gather="int4"), again, "plan.json",
                  World(0, 2, 0, 2), __import__("torch").device("cpu"))
    # trained as planned, in two gloo processes: FSDP2 with TLq-HS and the int8 gather, without the flags
    plan_path = tmp_path / "plan.json"
    again.save(plan_path)
    settings = run_workers(_train_plan, 2, str(plan_path), str(tmp_path / "run"))
    assert settings[0]["parallel"] == "fsdp" and settings[0]["weight_gather"] == "int8", settings[0]
    # a plan of FSDP2's own gather refuses --weight-gather int8 (it was priced with bf16 gathers)
    bf16 = plan_from_profile(profile, 10**15, error_cap=None,
                             knobs=ProblemSettings(layout="fsdp", gradient_mode="sdp4bit", micro_batch=2))
    assert "weight_gather" not in bf16.to_dict()["parallel"]
    with pytest.raises(ValueError, match="--weight-gather int8 contradicts"):
        reconcile(TrainConfig(model="llama-tiny", device="cpu", weight_gather="int8"), bf16, "plan.json",
                  World(0, 2, 0, 2), __import__("torch").device("cpu"))


def _train_plan(rank, world, plan, out):
    from agoq.train.trainer import TrainConfig, train

    assert train(TrainConfig(model="llama-tiny", device="cpu", dtype="fp32", plan=plan, steps=2, checkpoint_every=0,
                             eval_every=2, eval_batches=1, quiet=True, out=out)) == 0
    return json.loads((Path(out) / "run.json").read_text())["settings"]


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_every_configuration_trains_the_global_batch_in_the_layout_asked(tmp_path, seed, layout):
    rng = random.Random(seed)
    profile = _profile(tmp_path, rng)
    batch = rng.choice([4, 6])
    space = knob_space(layout=layout, global_batch=batch)
    try:  # tight: the smallest budget any plan fits
        plan_from_profile(profile, 1, error_cap=None, space=space, alternatives=False)
    except InfeasibleBudget as e:
        least = e.smallest_budget
    for budget in (10**15, int(least * rng.uniform(1.0, 1.2))):
        plan = plan_from_profile(profile, budget, error_cap=None, space=space)
        data = plan.to_dict()
        assert plan.training.micro_batch * plan.training.grad_accum == batch, (seed, layout)
        assert plan_layout(plan) == layout and data["decision"]["knobs"]["layout"] == layout, (seed, layout)
        assert data["launch"]["parallel"] == {"replicated": "ddp", "fsdp": "fsdp"}[layout]
        for alt in plan.alternatives:
            assert alt.micro_batch * alt.grad_accum == batch, (seed, layout, alt.name)
            assert alt.layout == layout, (seed, layout, alt.name)


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_compiles_budget_pays_its_layouts_calibrated_communication_and_peak(tmp_path, seed, layout):
    rng = random.Random(seed)
    plain = _profile(tmp_path, rng)
    at = price(plain, Configuration(ProblemSettings(layout=layout, gradient_mode="bf16", micro_batch=2,
                                                    compile_mode="compiled", optimizer="adamw8bit", master="fp32")))
    exposed, margin = rng.uniform(1e-3, 3e-2), rng.randrange(-10**5, 10**6)
    row = {**_layout_row(layout, "bf16", "bf16", at.step_seconds - at.communication_seconds + exposed),
           "compile": "compiled", "peak_bytes": at.peak_bytes + margin}
    calibrated = _profile(tmp_path / "again", random.Random(seed), layout_rows=[row])
    for mb, accum in ((2, 1), (1, 2)):
        for b in (0.5, 0.3):
            config = Configuration(ProblemSettings(layout=layout, gradient_mode="bf16", micro_batch=mb,
                                                   grad_accum=accum, compile_mode="compiled"),
                                   activation_memory_budget=b)
            before, after = price(plain, config), price(calibrated, config)
            comm = max(0.0, exposed + before.communication_seconds - at.communication_seconds)
            assert after.communication_seconds == pytest.approx(comm, rel=1e-9, abs=1e-12), (seed, mb, b)
            assert after.step_seconds == pytest.approx(before.step_seconds - before.communication_seconds + comm,
                                                       rel=1e-9), (seed, mb, b)
            assert abs(after.peak_bytes - (before.peak_bytes + margin)) <= 2, (seed, mb, b)
