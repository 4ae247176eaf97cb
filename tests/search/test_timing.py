"""agoq.search.timing: what a measured step prices at, read robustly (a compiled row its fastest steady step times
the profile's median-to-fastest ratio of compiled rows, an eager row its median), checked against a plain
recomputation on random per-step times, and shown to hold a composed price still where one row's median sits in a
slow phase."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from agoq.formats.profile import load_profile
from agoq.search.timing import StepPrices
from tests.search.synthetic_profile import write_profile


def _noisy_steps(rng: random.Random, seconds: float, count: int) -> list[float]:
    """A warm-up step (faster than any steady one, so that taking it would show), then `count` steady steps a few
    per cent above `seconds` (noise only slows a step)."""
    return [seconds * 0.5] + [seconds * (1 + rng.uniform(0.0, 0.03)) for _ in range(count)]


def _profile(tmp_path, seed: int, slow_row=None, slow_by: float = 0.0, per_step: bool = True):
    """A synthetic profile whose measured rows carry per-step seconds around their true seconds (the same seed gives
    the same true seconds and noise); in the row `slow_row` picks (a predicate), every steady step but its fastest
    is `slow_by` slower. Returns (profile, rows as written)."""
    folder = write_profile(tmp_path / f"p{seed}-{slow_by}-{per_step}", random.Random(seed), num_layers=5,
                           micro_batch=2, compile_modes=("eager", "compiled"))
    path = folder / "profile.json"
    data = json.loads(path.read_text())
    rng = random.Random(seed * 7919)
    for row in data["measured_steps"]["rows"]:
        if not per_step:
            continue
        steps = _noisy_steps(rng, row["step_seconds"], rng.randint(4, 9))
        if slow_row is not None and slow_row(row):
            fastest = steps.index(min(steps[1:]))
            steps = [t if i in (0, fastest) else t * (1 + slow_by) for i, t in enumerate(steps)]
        row["seconds_per_step"] = steps
        row["steps"] = len(steps)
        row["step_seconds"] = statistics.median(steps[1:])
    path.write_text(json.dumps(data))
    return load_profile(folder), data["measured_steps"]["rows"]


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_a_compiled_row_prices_at_its_fastest_steady_step_times_its_modes_ratio(tmp_path, seed):
    profile, rows = _profile(tmp_path, seed)
    sp = StepPrices(profile)
    mine = [r for r in rows if r["compile"] == "compiled"]
    ratios = sorted(r["step_seconds"] / min(r["seconds_per_step"][1:]) for r in mine)
    n = len(ratios)
    factor = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    assert sp.median_to_fastest == {"compiled": pytest.approx(factor, rel=1e-12)}
    for r in mine:
        fastest = min(r["seconds_per_step"][1:])  # the warm-up step, faster still, is not taken
        assert sp.price(r) == pytest.approx(fastest * factor, rel=1e-12)
        assert sp.price(r) > r["seconds_per_step"][0]


@pytest.mark.parametrize("seed", [4, 23])
def test_an_eager_row_prices_at_its_median_however_far_its_fastest_step_lies_below(tmp_path, seed):
    """An eager step's jitter is the host's, and a run meets it: a row whose steady steps but the fastest are
    `slow_by` slower prices at its median (as the profile keeps it), not near its fastest step."""
    slow_by = random.Random(seed).uniform(0.08, 0.25)
    profile, rows = _profile(tmp_path, seed, slow_row=lambda r: r["compile"] == "eager", slow_by=slow_by)
    sp = StepPrices(profile)
    for r in (r for r in rows if r["compile"] == "eager"):
        steady = r["seconds_per_step"][1:]
        assert sp.price(r) == r["step_seconds"] == statistics.median(steady)
        assert sp.price(r) > min(steady) * (1 + slow_by) * 0.99


def test_rows_without_their_steps_price_at_their_median(tmp_path):
    profile, rows = _profile(tmp_path, 5, per_step=False)
    sp = StepPrices(profile)
    assert sp.median_to_fastest == {}
    for r in rows:
        assert sp.price(r) == r["step_seconds"]
    assert sp.seconds("compiled", 2, 1) == next(r["step_seconds"] for r in rows if (
        r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"], r["optimizer"], r["master"])
        == ("compiled", "bf16", 2, 1, "bf16", "adamw8bit", "fp32"))


@pytest.mark.parametrize("seed", [2, 17])
def test_a_slow_phase_in_the_anchor_does_not_move_a_composed_price(tmp_path, seed):
    """The anchor row (compiled bf16 at the profiled split, base optimizer) with all its steady steps but one 9 %
    slower moves its median by about 9 %; QuanGrad over float32 AdamW, priced as anchor + two measured differences, subtracts the
    anchor twice, so the median would move that price by about 9 %. The robust price keeps it within 3 %."""
    def anchor(row):
        return (row["compile"], row["policy"], row["micro_batch"], row["grad_accum"], row["gradients"],
                row["optimizer"], row["master"]) == ("compiled", "bf16", 2, 1, "bf16", "adamw8bit", "fp32")

    calm, calm_rows = _profile(tmp_path, seed)
    slowed, slowed_rows = _profile(tmp_path, seed, slow_row=anchor, slow_by=0.09)
    a, b = StepPrices(calm), StepPrices(slowed)
    medians = [next(r for r in rows if anchor(r))["step_seconds"] for rows in (calm_rows, slowed_rows)]
    assert medians[1] > 1.05 * medians[0]  # the slow phase is in the median

    def composed(sp):
        return sp.seconds("compiled", 2, 1, "quangrad8", "adamw", "fp32")

    assert composed(b) == pytest.approx(composed(a), rel=0.03)
    # what the medians would have priced: anchor + (adamw - anchor) + (quangrad - anchor)
    def by_median(rows, **key):
        want = {"compile": "compiled", "policy": "bf16", "micro_batch": 2, "grad_accum": 1, "gradients": "bf16",
                "optimizer": "adamw8bit", "master": "fp32", **key}
        return next(r["step_seconds"] for r in rows if all(r[k] == v for k, v in want.items())
                    and r["activation_memory_budget"] is None)

    def median_price(rows):
        return by_median(rows, optimizer="adamw") + by_median(rows, gradients="quangrad8") - by_median(rows)

    assert abs(median_price(slowed_rows) / median_price(calm_rows) - 1) > 0.05


@pytest.mark.parametrize("seed", [6, 31])
def test_an_eager_split_whose_steps_ranged_wide_is_noted_in_the_plan(tmp_path, seed):
    """`spread` is the widest slowest/fastest - 1 of the split's anchors' steady steps (checked against a plain
    recomputation); a problem at an eager split whose anchors ranged more than 5 % says so in its notes, with that
    row's range, and a quiet one (steps within 3 %) and a compiled one do not."""
    from agoq.search.costs import EAGER_SPREAD_NOTE, ProblemSettings, build_problem

    slow_by = random.Random(seed).uniform(0.12, 0.3)
    profile, rows = _profile(tmp_path, seed, slow_row=lambda r: r["compile"] == "eager" and r["policy"] == "bf16",
                             slow_by=slow_by)
    sp = StepPrices(profile)
    anchors = [r for r in rows if (r["compile"], r["micro_batch"], r["grad_accum"], r["gradients"], r["optimizer"],
                                   r["master"]) == ("eager", 2, 1, "bf16", "adamw8bit", "fp32")
               and r["policy"] in ("bf16", "agoq-paper", "checkpoint-all") and r["activation_memory_budget"] is None]
    want = max(max(r["seconds_per_step"][1:]) / min(r["seconds_per_step"][1:]) - 1 for r in anchors)
    wide, row = sp.spread("eager", 2, 1)
    assert wide == pytest.approx(want, rel=1e-12) and wide > EAGER_SPREAD_NOTE
    assert row["policy"] == "bf16"
    noisy = build_problem(profile, ProblemSettings(compile_mode="eager", micro_batch=2, optimizer="adamw8bit",
                                                   master="fp32"))
    said = [n for n in noisy.notes if n.startswith("eager steps at micro-batch 2 x 1 ranged")]
    assert len(said) == 1 and f"{min(row['seconds_per_step'][1:]) * 1e3:.1f}-" in said[0], noisy.notes
    compiled = build_problem(profile, ProblemSettings(compile_mode="compiled", micro_batch=2, optimizer="adamw8bit",
                                                      master="fp32"))
    assert not [n for n in compiled.notes if "ranged" in n]
    quiet_profile, _ = _profile(tmp_path, seed + 1000)
    quiet = build_problem(quiet_profile, ProblemSettings(compile_mode="eager", micro_batch=2, optimizer="adamw8bit",
                                                         master="fp32"))
    assert not [n for n in quiet.notes if "ranged" in n]
