"""The one price (agoq.search.price): a plan and every alternative priced again as the configuration it runs give
the figures the search wrote; compile's activation_memory_budget pays its layout's all-reduce and trains the
requested split; the layout the search was asked for binds the alternatives."""

from __future__ import annotations

import json
import random

import pytest

from agoq.formats.profile import load_profile
from agoq.search.alternatives import price_alternatives
from agoq.search.calibration import margin
from agoq.search.costs import ProblemSettings, build_problem, state_parts
from agoq.search.plan_builder import plan_of_alternative
from agoq.search.price import Configuration, plan_layout, price
from agoq.search.request import InfeasibleBudget, knob_space
from agoq.search.search import plan_from_profile
from tests.search.synthetic_profile import write_profile


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def _profile(tmp_path, rng, world_size: int = 1, link: float = 1e10):
    """A 3-layer profile with eager and compiled measured steps, and compiled steps under activation_memory_budget
    0.5 and 0.3 at micro-batch 2 (one micro-batch) and 1 (two micro-batches)."""
    folder = write_profile(tmp_path / f"p{world_size}", rng, num_layers=3, micro_batch=2, seq_len=29,
                           compile_modes=("eager", "compiled"), world_size=world_size, collectives=world_size > 1,
                           fsdp_collectives=world_size > 1, link_bytes_per_second=link, layer_forward=True)
    header = json.loads((folder / "profile.json").read_text())
    rows = header["measured_steps"]["rows"]
    for mb, accum in ((2, 1), (1, 2)):
        bf16 = next(r for r in rows if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"],
                                        r["optimizer"], r["master"], r["activation_memory_budget"])
                    == ("compiled", "bf16", mb, accum, "bf16", "adamw8bit", "fp32", None))
        for b in (0.5, 0.3):
            rows.append({**bf16, "activation_memory_budget": b,
                         "step_seconds": bf16["step_seconds"] * rng.uniform(1.02, 1.2),
                         "peak_bytes": rng.randrange(10**6, 10**7)})
    (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder)


def _step(profile, mb, accum, compile_mode="compiled", budget=None, optimizer="adamw8bit", master="fp32"):
    rows = profile.header["measured_steps"]["rows"]
    return next(r for r in rows if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"],
                                    r["optimizer"], r["master"], r["activation_memory_budget"])
                == (compile_mode, "bf16", mb, accum, "bf16", optimizer, master, budget))


def test_a_plan_priced_again_is_what_the_search_predicted(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng)
    roomy = max(price(profile, Configuration(ProblemSettings(micro_batch=2))).peak_bytes_per_stage)
    for budget in (roomy, int(roomy * rng.uniform(0.6, 0.9))):
        try:
            plan = plan_from_profile(profile, budget, error_cap=None)
        except InfeasibleBudget as e:  # below the least that fits: plan at that
            plan = plan_from_profile(profile, e.smallest_budget, error_cap=None)
        again = price(profile, Configuration.of_plan(plan))
        if plan.decision.agoq:  # the MILP's figures
            assert again.step_seconds == pytest.approx(plan.predicted.step_seconds, rel=1e-9), seed
            assert again.peak_bytes_per_stage == list(plan.predicted.peak_bytes_per_stage), seed


def test_every_alternative_written_as_a_plan_prices_the_same(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng)
    roomy = max(price(profile, Configuration(ProblemSettings(micro_batch=2))).peak_bytes_per_stage)
    budget = int(roomy * rng.uniform(0.7, 1.1))
    try:
        plan = plan_from_profile(profile, budget, error_cap=None)
    except InfeasibleBudget as e:  # below the least that fits: plan at that
        plan = plan_from_profile(profile, e.smallest_budget, error_cap=None)
    assert plan.alternatives, seed
    checked = 0
    for alt in plan.alternatives:
        as_plan = plan_of_alternative(plan.model_copy(update={"alternative": alt}), "test", profile)
        again = price(profile, Configuration.of_plan(as_plan))
        assert again.step_seconds == pytest.approx(alt.predicted.step_seconds, rel=1e-9), (seed, alt.name)
        assert again.peak_bytes == alt.predicted.peak_bytes, (seed, alt.name)
        assert plan_layout(as_plan) == alt.layout == "replicated", (seed, alt.name)
        checked += 1
    assert any(a.activation_memory_budget for a in plan.alternatives), seed  # compile's budget is among them
    assert checked == len(plan.alternatives)


def test_compile_budget_pays_its_all_reduce_and_trains_the_requested_split(tmp_path):
    seed, rng = fresh_rng()
    link = rng.uniform(2e7, 1e8)
    profile = _profile(tmp_path, rng, world_size=2, link=link)
    accum = rng.choice([3, 5])
    priced = price_alternatives(profile, 10**15, [(1, accum), (2, accum)], ["compiled"])
    points = [a for a in priced if a.activation_memory_budget is not None]
    assert points and {(a.micro_batch, a.grad_accum) for a in priced} <= {(1, accum), (2, accum)}, seed
    # the synthetic table's bf16 all-reduce takes message bytes / link seconds at every size (a line through 0)
    comm = 4 * profile.header["model"]["parameters"] / link
    assert comm > 0.01 * min(a.step_seconds for a in points), seed  # a slow link: communication matters here
    for a in points:
        assert a.name.startswith("DDP "), a.name
        assert a.communication_seconds == pytest.approx(comm, rel=1e-9), (seed, a.name)
        row = _step(profile, a.micro_batch, 1 if a.micro_batch == 2 else 2, budget=a.activation_memory_budget)
        a0 = row["grad_accum"]
        # the bf16 steps' line through one and two micro-batches at this micro-batch, read at a and at a0
        one, two = _step(profile, a.micro_batch, 1)["step_seconds"], _step(profile, a.micro_batch, 2)["step_seconds"]
        line = lambda n: one + (two - one) * (n - 1)  # noqa: E731
        opt = 0.0 if a.optimizer == "adamw8bit" else \
            _step(profile, 2, 1, optimizer=a.optimizer)["step_seconds"] - _step(profile, 2, 1)["step_seconds"]
        expected = row["step_seconds"] + line(accum) - line(a0) + opt + comm
        assert a.step_seconds == pytest.approx(expected, rel=1e-9), (seed, a.name)
        kept = state_parts(profile, "bf16", a.optimizer, a.master)["gradients"] if a0 == 1 else 0.0
        assert a.peak_bytes >= int(row["peak_bytes"] + kept + margin(profile, "compiled")[0]) - 1, (seed, a.name)


def test_the_requested_layout_binds_the_alternatives(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng, world_size=2, link=rng.uniform(2e8, 2e9))
    fsdp = price_alternatives(profile, 10**15, [(2, 1)], ["eager", "compiled"], layouts=("fsdp",))
    assert fsdp and all(a.layout == "fsdp" and a.name.startswith("FSDP2 ") for a in fsdp), seed
    # compile's budget under FSDP2 is priced from the compiled bf16 step's peak, which this profile did not measure
    assert not [a for a in fsdp if a.activation_memory_budget is not None]
    for a in fsdp:  # each priced as FSDP2 prices it: the same knobs' problem under fsdp
        knobs = ProblemSettings(gradient_mode="bf16", optimizer=a.optimizer, master=a.master, compile_mode=a.compile,
                                micro_batch=a.micro_batch, grad_accum=a.grad_accum, layout="fsdp")
        problem = build_problem(profile, knobs)
        assert a.communication_seconds == pytest.approx(problem.communication_seconds, rel=1e-12)
    for layout in ("fsdp",):
        space = knob_space(layout=layout)
        plan = plan_from_profile(profile, 10**15, error_cap=None, space=space)
        launch = plan.to_dict()["launch"]["parallel"]
        assert plan_layout(plan) == layout and plan.decision.knobs["layout"] == layout, (seed, layout, launch)
        assert all(a.layout == "fsdp" for a in plan.alternatives), (seed, layout)


def test_a_checkpoint_measured_faster_than_keeping_is_priced_at_no_extra_time(tmp_path):
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng)
    header = json.loads((profile.path / "profile.json").read_text())
    rows = header["measured_steps"]["rows"]

    def split(r):
        return (r["compile"], r["micro_batch"], r["grad_accum"], r["gradients"], r["optimizer"], r["master"],
                r["activation_memory_budget"])

    bf16 = {split(r): r["step_seconds"] for r in rows if r["policy"] == "bf16"}
    for r in rows:  # a loaded CPU: every eager checkpoint-all step measured faster than bf16 at its split
        if r["compile"] == "eager" and r["policy"] == "checkpoint-all":
            r["step_seconds"] = bf16[split(r)] * rng.uniform(0.5, 0.95)
    (profile.path / "profile.json").write_text(json.dumps(header))
    profile = load_profile(profile.path)
    knobs = ProblemSettings(micro_batch=2, compile_mode="eager", optimizer="adamw8bit", master="fp32")
    kept = price(profile, Configuration(knobs))
    L = profile.num_layers
    every = price(profile, Configuration(knobs, checkpoint_layers=tuple(range(L))))
    assert every.step_seconds == pytest.approx(kept.step_seconds, rel=1e-12), seed
    assert any("faster than bf16" in n for n in build_problem(profile, knobs).notes), seed


def test_a_compile_budget_step_moved_below_zero_is_left_out(tmp_path):
    """Noisy measurements (a small model on a busy CPU) can make the bf16 line fall with more micro-batches by more
    than compile's budget step: moved there, that step prices at or below zero. It is refused (ValueError) and left
    out of the alternatives, and the plan beside it is still made."""
    seed, rng = fresh_rng()
    profile = _profile(tmp_path, rng)
    header = json.loads((profile.path / "profile.json").read_text())
    rows = header["measured_steps"]["rows"]
    one, two = _step(profile, 2, 1), _step(profile, 2, 2)
    b = rng.choice([0.5, 0.3])
    row = _step(profile, 2, 1, budget=b)
    bad = next(r for r in rows if r == row)
    bad["step_seconds"] = rng.uniform(0.1, 0.9) * abs(two["step_seconds"] - one["step_seconds"])
    next(r for r in rows if r == two)["step_seconds"] = one["step_seconds"] - (two["step_seconds"] - one["step_seconds"])
    (profile.path / "profile.json").write_text(json.dumps(header))
    profile = load_profile(profile.path)
    moved = _step(profile, 2, 1, budget=b)["step_seconds"] + _step(profile, 2, 2)["step_seconds"] \
        - _step(profile, 2, 1)["step_seconds"]
    assert moved <= 0, seed  # the configuration this test is about
    with pytest.raises(ValueError, match="measurement noise"):
        price(profile, Configuration(ProblemSettings(micro_batch=2, grad_accum=2, compile_mode="compiled"),
                                    activation_memory_budget=b))
    priced = price_alternatives(profile, 10**15, [(2, 2)], ["compiled"])
    assert priced and all(a.step_seconds > 0 for a in priced), seed
    assert b not in {a.activation_memory_budget for a in priced}, seed
    plan = plan_from_profile(profile, 10**15, error_cap=None)
    assert plan.predicted.step_seconds > 0 and all(a.predicted.step_seconds > 0 for a in plan.alternatives), seed
