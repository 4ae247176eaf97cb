"""The search runs plans only through the measurement it is given: it imports nothing of the training stage, and
asked to validate or measure trials without one it says so before any work."""

import random
import subprocess
import sys

import pytest

from agoq.formats.profile import load_profile
from agoq.search.search import search
from agoq.search.validation import validate_plans
from tests.search.synthetic_profile import write_profile


def test_the_search_imports_no_training():
    code = ("import sys, agoq.search.search, agoq.search.validation, agoq.search.study, agoq.commands.search; "
            "print(sorted(m for m in sys.modules if m.startswith('agoq.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("asked", [dict(validate=1), dict(method="optuna", trials=2, measure_trials=True)])
def test_validating_without_a_measurement_is_refused(tmp_path, asked):
    profile = load_profile(write_profile(tmp_path / "p", random.Random(3), micro_batch=2, seq_len=40))
    with pytest.raises(ValueError, match="pass measure="):
        search(profile, 10**12, progress=False, front_budgets=0, storage=f"sqlite:///{tmp_path / 's.db'}", **asked)
    assert not (tmp_path / "s.db").exists()  # refused before the study was made


def test_validate_plans_runs_the_measurement_it_is_given():
    """The jobs the search hands to `measure`: each plan's data and batch, sdp4bit plans with bf16 gradients (one
    process), then the plain bf16 reference once per batch shape; the figures land in `measured`."""
    from agoq.formats.plan import Plan
    from agoq.models import build, fingerprint

    model = build("llama-tiny", device="meta")
    ref = {"name": "t", "fingerprint": fingerprint(model)}
    plans = [Plan(model=ref, layers=[{"layer": i} for i in range(3)], gradients={"mode": mode},
                  training={"micro_batch": mb, "seq_len": 21})
             for mode, mb in (("bf16", 2), ("sdp4bit", 2), ("quangrad8", 3))]
    jobs = []

    def measure(**job):
        jobs.append(job)
        plain = job["plan"] is None
        return {"peak_bytes": None, "first_step_peak_bytes": None, "step_seconds": 2.0 if plain else 1.0,
                "losses": [4.0, 2.0] if plain else [5.0, 2.5], "device": "cpu"}

    validate_plans(plans, {"n": 1}, measure=measure, dtype="fp32", steps=2, progress=False)
    assert [j["plan"] is None for j in jobs] == [False, False, False, True, True]
    assert [j["gradients"] for j in jobs[:3]] == [None, "bf16", None]
    assert [(j["micro_batch"], j["seq_len"]) for j in jobs[3:]] == [(2, 21), (3, 21)]
    for p in plans:
        assert p.measured.step_seconds == 1.0 and p.measured.loss_deviation == pytest.approx(0.25)
        assert p.measured.model_extra["bf16_step_seconds"] == 2.0
    assert "bf16 gradients" in plans[1].measured.model_extra["gradients"]
