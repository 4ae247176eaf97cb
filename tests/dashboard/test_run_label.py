"""What the run table says a run trained with: its plan, or without one what it is (baseline, or the policy,
gradients and optimizer it was given) and the dtype it computed in, as run.json's settings record them."""

import pytest

from dashboard.runs import run_label


@pytest.mark.parametrize("settings, label", [
    ({"dtype": "float32", "gradients": "bf16", "policy": None, "optimizer": "adamw"}, "baseline (no plan), fp32"),
    ({"dtype": "bfloat16", "gradients": "bf16", "policy": None}, "baseline (no plan), bf16"),
    ({}, "baseline (no plan), bf16"),  # older records without a dtype: agoq train's GPU default
    ({"dtype": "float16", "policy": "agoq-paper"}, "policy agoq-paper (no plan), fp16"),
    ({"dtype": "float32", "gradients": "quangrad8", "optimizer": "adamw8bit"},
     "quangrad8 gradients, adamw8bit (no plan), fp32"),
])
def test_runs_without_a_plan(settings, label):
    assert run_label(None, settings) == label


def test_runs_with_a_plan():
    plan = {"budget_bytes": 3 * 2**20 + 123_457, "source": {"method": "milp"}}
    assert run_label(plan, {"dtype": "float32"}) == "plan (milp), budget 3.12 MiB"
    assert run_label({}, {"dtype": "float32"}) == "plan"
