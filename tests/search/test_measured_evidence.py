"""The calibrated cost model against real measurements: the probe model profiled on one H100
(agoq/examples/profiles/probe-h100) and the training runs of experiments/results/plan_accuracy_probe_before.json,
both made by the run of commit 1116fab. Every configuration those runs trained through `agoq train` that the profile
can price (the others are not offered: the profile measured no step of their kind) is predicted at or above its
measured peak and within 2 % of it, and within 5 % of its measured median step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from agoq.examples import profiles
from agoq.formats.profile import load_profile
from agoq.search.costs import ProblemSettings, build_problem

RESULTS = Path(__file__).resolve().parents[2] / "experiments" / "results" / "plan_accuracy_probe_before.json"
NAME = re.compile(r"(eager|compiled) (bf16|full checkpointing|selective checkpointing \((\d+)/(\d+) layers\)), "
                  r"(8-bit AdamW|AdamW)(?:, micro-batch (\d+) x (\d+))?")


def _alternatives() -> list[dict]:
    """The alternatives the run trained: knobs read from their names, and what `agoq train` measured."""
    out = []
    for budget in json.loads(RESULTS.read_text())["figures"]["budgets"]:
        for alt in budget.get("alternatives", []):
            m = NAME.fullmatch(alt["name"])
            if m is None or not alt.get("measured", {}).get("peak_bytes"):
                continue
            compile_mode, what, k, _, optimizer, mb, accum = m.groups()
            checkpointed = 0 if what == "bf16" else 16 if what.startswith("full") else int(k)
            out.append({"name": alt["name"], "compile": compile_mode, "checkpointed": checkpointed,
                        "optimizer": "adamw8bit" if optimizer == "8-bit AdamW" else "adamw",
                        "micro_batch": int(mb or 2), "grad_accum": int(accum or 1), "measured": alt["measured"]})
    return out


@pytest.fixture(scope="module")
def probe():
    return load_profile(profiles()["probe-h100"])


def test_the_run_and_the_profile_are_the_same_commits():
    assert json.loads(RESULTS.read_text())["commit"].startswith("1116fab")
    assert len(_alternatives()) >= 4


def test_priced_configurations_are_predicted_within_their_measurement(probe):
    priced = 0
    for alt in _alternatives():
        knobs = ProblemSettings(gradient_mode="bf16", optimizer=alt["optimizer"], master="fp32",
                                compile_mode=alt["compile"], micro_batch=alt["micro_batch"],
                                grad_accum=alt["grad_accum"])
        try:
            problem = build_problem(probe, knobs)
        except ValueError as e:
            assert "measured no" in str(e), e  # not offered: the profile has no step of that kind
            continue
        if alt["checkpointed"] and not problem.allow_checkpoint:
            continue
        L = problem.num_layers
        ckpt = np.arange(L) < alt["checkpointed"]  # the probe's layers are alike: which ones does not matter
        chosen = np.array([i for i in np.nonzero(problem.keeps_16bit())[0] if not ckpt[problem.layer[i]]], dtype=int)
        figures = problem.evaluate(chosen, ckpt)
        peak, measured = max(figures["peak_bytes_per_stage"]), alt["measured"]["peak_bytes"]
        assert measured <= peak <= 1.02 * measured, (alt["name"], peak, measured, problem.notes)
        assert figures["step_seconds"] == pytest.approx(alt["measured"]["step_seconds"], rel=0.05), alt["name"]
        priced += 1
    assert priced >= 1


def test_the_profiles_own_steps_are_reproduced(probe):
    """The calibration's anchors: the compiled bf16, agoq-paper and checkpoint-all steps at the profiled split are
    predicted at or above their measured peaks (bf16 and checkpoint-all exactly; a LAAQ layer's saving is not
    counted), and their step times exactly."""
    from agoq.formats.measured_steps import measured_rows
    from agoq.search.costs import recipe_choice

    problem = build_problem(probe, ProblemSettings(gradient_mode="bf16", optimizer="adamw8bit", master="fp32",
                                                   compile_mode="compiled"))
    L = problem.num_layers
    rows = {r["policy"]: r for r in measured_rows(probe.header) if r["compile"] == "compiled"
            and r["micro_batch"] == 2 and r["activation_memory_budget"] is None}
    choices = {"bf16": (np.nonzero(problem.keeps_16bit())[0], np.zeros(L, dtype=bool)),
               "checkpoint-all": (np.array([], dtype=int), np.ones(L, dtype=bool)),
               "agoq-paper": (recipe_choice(problem), np.zeros(L, dtype=bool))}
    for policy, (chosen, ckpt) in choices.items():
        figures = problem.evaluate(chosen, ckpt)
        peak = max(figures["peak_bytes_per_stage"])
        assert peak >= rows[policy]["peak_bytes"], policy
        if policy != "agoq-paper":  # less the margin the search keeps on top (agoq.search.calibration)
            kept = float(problem.static_parts.get("margin", [0.0])[0])
            assert peak - kept == pytest.approx(rows[policy]["peak_bytes"], abs=2), policy
        assert figures["step_seconds"] == pytest.approx(rows[policy]["step_seconds"], rel=1e-9), policy
