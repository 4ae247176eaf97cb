"""Never slower than the obvious: where the search cannot show a plan with agoq is faster than what a user runs
without it, the plan is that alternative (a plan with no agoq in it), and a plan that keeps everything says so;
agoq train runs such a plan (torch.compile's activation_memory_budget included)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from agoq.formats.plan import plan_from_dict
from agoq.formats.profile import load_profile
from agoq.search.costs import ProblemSettings, build_problem
from agoq.search.knobs import KnobSpace, budget_bounds
from agoq.search.plan_alternatives import FASTER_BY
from agoq.search.search import plan_from_profile
from agoq.train.config import TrainConfig
from agoq.train.plan_settings import check_flags_against_plan, given_settings, plan_settings
from tests.search.synthetic_profile import write_profile


def _compiled_profile(tmp_path, rng, point_peak=None):
    """A compiled (and eager) synthetic profile; with `point_peak`, a compiled bf16 step under
    activation_memory_budget 0.3 as fast as compiled bf16 with that peak."""
    folder = write_profile(tmp_path / "p", rng, num_layers=3, micro_batch=2, seq_len=29,
                           compile_modes=("eager", "compiled"))
    if point_peak is not None:
        header = json.loads((folder / "profile.json").read_text())
        rows = header["measured_steps"]["rows"]
        bf16 = next(r for r in rows if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"],
                                        r["optimizer"], r["master"]) == ("compiled", "bf16", 2, 1, "bf16",
                                                                         "adamw8bit", "fp32"))
        rows.append({**bf16, "activation_memory_budget": 0.3, "peak_bytes": int(point_peak)})
        (folder / "profile.json").write_text(json.dumps(header))
    return folder


def test_a_faster_alternative_is_the_plan(tmp_path, seed):
    rng = random.Random(seed)
    folder = _compiled_profile(tmp_path, rng)
    least, _ = budget_bounds(load_profile(folder))
    folder = _compiled_profile(tmp_path, random.Random(seed), point_peak=least)
    profile = load_profile(folder)
    from agoq.search.calibration import margin
    plan = plan_from_profile(profile, int(least + margin(profile, "compiled")[0]) + 1, error_cap=None)
    assert plan.decision.agoq is False, plan.decision.reason
    assert "no agoq" in plan.decision.reason
    assert all(s == 16 for lp in plan.layers for s in lp.kinds.values()) and not plan.checkpoint_layers()
    assert plan.training.compile == "compiled" and plan.training.activation_memory_budget == 0.3
    assert plan.gradients.mode == "bf16" and plan.source.method == "alternative"
    assert plan.alternative.name.startswith("agoq:")  # the plan with agoq it replaced, kept beside it
    assert plan.alternative.predicted.step_seconds >= plan.predicted.step_seconds / (1 + FASTER_BY)
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.training.activation_memory_budget == 0.3
    # agoq train takes the budget from the plan, and refuses a flag that contradicts it
    decided = plan_settings(again, "none")
    assert decided["activation_memory_budget"] == 0.3 and decided["compile"] is True
    with pytest.raises(ValueError, match="activation_memory_budget"):
        check_flags_against_plan(given_settings(TrainConfig(activation_memory_budget=0.5, compile=True)), decided,
                                 again, "plan.json")


def test_a_plan_that_keeps_everything_says_so(tmp_path, seed):
    profile = load_profile(_compiled_profile(tmp_path, random.Random(seed)))
    problem = build_problem(profile, ProblemSettings(compile_mode="compiled"))
    sixteen = np.nonzero(problem.keeps_16bit())[0]
    peak = max(problem.evaluate(sixteen, np.zeros(problem.num_layers, dtype=bool))["peak_bytes_per_stage"])
    plan = plan_from_profile(profile, peak, error_cap=None, space=KnobSpace(gradient_modes=("bf16",)))
    assert plan.decision.agoq is False and "no agoq needed" in plan.decision.reason
    assert all(s == 16 for lp in plan.layers for s in lp.kinds.values()) and not plan.checkpoint_layers()


@pytest.mark.parametrize("value,words", [(0.0, "(0, 1]"), (1.5, "(0, 1]"), (-0.1, "(0, 1]")])
def test_activation_memory_budget_is_checked(value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        TrainConfig(activation_memory_budget=value, compile=True)
    with pytest.raises(ValueError, match="needs --compile"):
        TrainConfig(activation_memory_budget=0.5, compile=False)


def test_a_plan_budget_needs_a_compiled_plan(tmp_path, seed):
    profile = load_profile(_compiled_profile(tmp_path, random.Random(seed)))
    plan = plan_from_profile(profile, 10**12, error_cap=None).to_dict()
    plan["training"].update(compile="eager", activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="activation_memory_budget"):
        plan_from_dict(plan)


def test_an_alternative_replacing_a_pipeline_plan_keeps_its_stages(tmp_path, seed):
    """A pipeline profile's plan replaced by its alternative (priced in the same layout, bf16) keeps the stages and
    the layers' stage of each, with one predicted peak per stage: a valid plan (it once had one peak for three
    stages, which the plan's own check refused)."""
    from agoq.search.plan_builder import plan_of_alternative

    folder = write_profile(tmp_path / "p", random.Random(seed), num_layers=3, micro_batch=2, seq_len=29, stages=3,
                           in_flight=[3, 2, 1])
    profile = load_profile(folder)
    least, _ = budget_bounds(profile)
    plan = plan_from_profile(profile, int(least * 1.5), error_cap=None)
    assert plan.pipeline.stages == 3 and plan.alternative is not None
    replaced = plan_of_alternative(plan, "test", profile)
    assert replaced.pipeline.stages == 3 and [lp.stage for lp in replaced.layers] == [lp.stage for lp in plan.layers]
    peaks = replaced.predicted.peak_bytes_per_stage
    assert len(peaks) == 3 and max(peaks) == plan.alternative.predicted.peak_bytes
    assert replaced.source.method == "alternative" and replaced.gradients.mode == "bf16"
    assert all(s == 16 for lp in replaced.layers for s in lp.kinds.values())
    assert plan_from_dict(json.loads(json.dumps(replaced.to_dict()))).pipeline.stages == 3
