"""The dashboard's HTML pieces (dashboard.pages)."""

from __future__ import annotations


def test_a_run_that_missed_its_plan_is_warned_about_not_marked_broken(seed):
    """`plan_check` warnings (a run that ran, off its plan) are warnings on the runs page, never the error box that
    marks a broken run; the table gives measured against predicted."""
    import random

    from dashboard.pages import plan_checks

    rng = random.Random(seed)
    predicted, budget = rng.randrange(10**9, 2 * 10**9), 3 * 10**9
    measured = predicted + rng.randrange(1, 10**8)
    step = rng.uniform(0.05, 0.2)
    check = {"steps": 41, "budget_bytes": budget, "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
             "peak_error": measured / predicted - 1, "predicted_step_seconds": step,
             "measured_step_seconds": step * 1.2, "step_error": 0.2,
             "warnings": ["the measured step is +20.0% off the plan's"]}
    html = plan_checks([{"id": "r/missed", "plan_check": check}, {"id": "r/none"}])
    assert 'class="msg warn"' in html and 'class="msg error"' not in html
    assert "r/missed: the measured step is +20.0% off" in html and "r/none" not in html
    assert f"{measured / predicted - 1:+.1%}" in html and "+20.0%" in html
    assert plan_checks([{"id": "r/none"}]) == ""
