"""Offload's price per layer from the profile's offloading steps (agoq.search.costs.offload_prices): what the step
with K layers offloaded took beyond the same step kept on the GPU, less what the link model already prices for its
bytes, charged per offloaded layer, at other accumulations on the line through one and two micro-batches; checked
against closed forms on synthetic profiles."""

import json
import random

import pytest

from agoq.formats.profile import load_profile
from agoq.search.costs import OVERLAP, build_problem
from agoq.search.problem import ProblemSettings
from agoq.search.timing import prices
from tests.search.synthetic_profile import write_profile


def fresh_rng():
    seed = random.getrandbits(32)
    return seed, random.Random(seed)


def profile_with_offload_rows(tmp_path, rng, *, layers: int, micro_batch: int, modes=("eager", "compiled"),
                              offload_modes=("eager", "compiled"), accums=(1, 2), delta=None, offloaded_bytes=0):
    """A synthetic profile with a host link, and an offloading row (agoq-paper, layers 0..layers-2 offloaded) beside
    each kept agoq-paper row of `offload_modes` and `accums`: its step `delta(row)` seconds longer."""
    link = {"d2h_bytes_per_second": rng.uniform(2e10, 6e10), "h2d_bytes_per_second": rng.uniform(2e10, 6e10),
            "bytes_per_copy": 256 << 20, "compute_slowdown": rng.uniform(0.0, 0.05), "pinnable_bytes": 10**11}
    folder = write_profile(tmp_path / "p", rng, num_layers=layers, micro_batch=micro_batch, layer_forward=True,
                           host_link=link, compile_modes=tuple(modes))
    header = json.loads((folder / "profile.json").read_text())
    rows = header["measured_steps"]["rows"]
    added = []
    for r in rows:
        if r["policy"] == "agoq-paper" and r["grad_accum"] in accums and r["compile"] in offload_modes:
            added.append({**r, "offload_layers": layers - 1, "offloaded_bytes": offloaded_bytes,
                          "step_seconds": r["step_seconds"] + delta(r)})
    header["measured_steps"] = {"version": 2, "rows": rows + added}
    (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder)


def test_a_layer_costs_what_the_measured_offload_took_beyond_the_kept_step(tmp_path):
    """With nothing for the link to price (no bytes), a layer's price per step is the measured difference over the
    K layers offloaded at the plan's compile mode and micro-batch: at one and two micro-batches what was measured,
    at more the line through them; a plan offloading k layers pays k of it."""
    seed, rng = fresh_rng()
    layers, micro_batch = rng.choice([3, 5, 7]), rng.choice([2, 4, 6])
    deltas = {}

    def delta(row):
        deltas[(row["compile"], row["micro_batch"], row["grad_accum"])] = d = rng.uniform(0.001, 0.05)
        return d

    profile = profile_with_offload_rows(tmp_path, rng, layers=layers, micro_batch=micro_batch, delta=delta)
    for (mode, m, a), d in deltas.items():
        if a != 1:
            continue
        one, two = d / (layers - 1), deltas[(mode, m, 2)] / (layers - 1)
        for accum in (1, 2, rng.choice([3, 4, 5])):
            p = build_problem(profile, ProblemSettings(compile_mode=mode, micro_batch=m, grad_accum=accum))
            expected = max(0.0, one + (two - one) * (accum - 1))
            assert p.offload is not None, f"seed {seed}"
            assert p.offload.layer_seconds == pytest.approx(expected, rel=1e-9, abs=1e-15), \
                f"seed {seed} {mode} {m} x {accum}"
            assert p.offload_seconds(1.0, 3)["layer_seconds"] == pytest.approx(3 * expected, rel=1e-9, abs=1e-15)


def test_what_the_link_model_prices_is_not_charged_twice(tmp_path):
    """An offloading step no slower than the link model prices its bytes leaves nothing per layer; one slower by x
    beyond it charges x / K."""
    seed, rng = fresh_rng()
    layers, micro_batch = 4, 2
    moved = int(rng.uniform(1e9, 3e9))
    extra = rng.uniform(0.001, 0.02)
    same = rng.getrandbits(32)  # the three profiles below: the same steps and link, offloading rows apart
    probe = profile_with_offload_rows(tmp_path / "a", random.Random(same), layers=layers, micro_batch=micro_batch,
                                      delta=lambda r: 0.0, offloaded_bytes=moved)
    link = probe.host_link
    per_byte = 1 / link["d2h_bytes_per_second"] + 1 / link["h2d_bytes_per_second"]
    sp = prices(probe)
    slowdown = link["compute_slowdown"]
    assert sp.m0 == micro_batch

    def model(row):  # the link model's price of the measured step's bytes (OffloadPrices), each micro-batch: copies
        a = row["grad_accum"]  # run under the kept step (OVERLAP of it), less the first layer
        window = OVERLAP * row["step_seconds"] / a * (layers - 1) / layers
        return a * (max(0.0, moved * per_byte - window) + slowdown * per_byte * moved)

    exact = profile_with_offload_rows(tmp_path / "b", random.Random(same), layers=layers, micro_batch=micro_batch,
                                      delta=model, offloaded_bytes=moved)
    for accum in (1, 2):
        p = build_problem(exact, ProblemSettings(compile_mode="eager", micro_batch=2, grad_accum=accum))
        assert p.offload.layer_seconds == pytest.approx(0.0, abs=1e-12), f"seed {seed}"
    slower = profile_with_offload_rows(tmp_path / "c", random.Random(same), layers=layers, micro_batch=micro_batch,
                                       delta=lambda r: model(r) + extra, offloaded_bytes=moved)
    for accum in (1, 2):
        p = build_problem(slower, ProblemSettings(compile_mode="eager", micro_batch=2, grad_accum=accum))
        assert p.offload.layer_seconds == pytest.approx(extra / (layers - 1), rel=1e-6), f"seed {seed}"


def test_offload_is_offered_only_where_it_was_measured(tmp_path):
    """Offloading steps measured eager only: a compiled problem offers no offload and says why; measured at one
    micro-batch per step only: an accumulating plan is offered none; a profile with no offloading step at all (made
    before agoq measured them) offers none, with a note: neither offload's time per layer nor its least peak is
    known."""
    seed, rng = fresh_rng()
    profile = profile_with_offload_rows(tmp_path / "a", rng, layers=4, micro_batch=2, offload_modes=("eager",),
                                        delta=lambda r: 0.01)
    assert build_problem(profile, ProblemSettings(compile_mode="eager")).offload is not None, f"seed {seed}"
    compiled = build_problem(profile, ProblemSettings(compile_mode="compiled"))
    assert compiled.offload is None
    assert any("no compiled offloading step" in n for n in compiled.notes), compiled.notes
    single = profile_with_offload_rows(tmp_path / "c", rng, layers=4, micro_batch=2, accums=(1,),
                                       delta=lambda r: 0.01)
    assert build_problem(single, ProblemSettings(compile_mode="eager", grad_accum=1)).offload is not None
    accumulating = build_problem(single, ProblemSettings(compile_mode="eager", grad_accum=3))
    assert accumulating.offload is None
    assert any("at 3 micro-batch(es) per step" in n for n in accumulating.notes), accumulating.notes
    older = profile_with_offload_rows(tmp_path / "b", rng, layers=4, micro_batch=2, offload_modes=(),
                                      delta=lambda r: 0.01)
    for mode in ("eager", "compiled"):
        p = build_problem(older, ProblemSettings(compile_mode=mode))
        assert p.offload is None, (seed, mode)
        assert any("not offered: the profile measured no offloading step" in n for n in p.notes), p.notes


def test_an_offloading_choice_peaks_at_no_less_than_the_measured_offloading_step(tmp_path):
    """The offloading step's measured peak, moved by the state bytes between its knobs and the plan's, is a floor
    under every choice that offloads (OffloadPrices.floor_bytes): from the step of the plan's accumulation (one
    micro-batch, or two for an accumulating plan), evaluate's peak never below it, and the MILP offloads nothing
    where the floor passes the budget."""
    import numpy as np

    from agoq.search.milp import InfeasibleBudget, Solver

    seed, rng = fresh_rng()
    layers, micro_batch = rng.choice([3, 5, 7]), rng.choice([2, 4, 6])
    lift = {}

    def delta(row):
        return rng.uniform(0.001, 0.01)

    profile = profile_with_offload_rows(tmp_path, rng, layers=layers, micro_batch=micro_batch, delta=delta,
                                        offloaded_bytes=10**6)
    for r in prices(profile).offload_rows:  # each offloading step peaks somewhat above its state bytes
        state = build_problem(profile, ProblemSettings(compile_mode=r["compile"], micro_batch=r["micro_batch"],
                                                       grad_accum=r["grad_accum"], allow_offload=False),
                              calibrate=False).static_bytes[0]
        lift[(r["compile"], r["micro_batch"], r["grad_accum"])] = r["peak_bytes"] = \
            int(state * rng.uniform(1.0, 1.3))
    for accum in (1, 2, rng.choice([3, 4])):
        knobs = ProblemSettings(compile_mode="compiled", micro_batch=micro_batch, grad_accum=accum,
                                gradient_mode=rng.choice(["bf16", "quangrad8"]))
        row_knobs = ProblemSettings(compile_mode="compiled", micro_batch=micro_batch, grad_accum=min(accum, 2),
                                    allow_offload=False)
        mine = float(build_problem(profile, knobs, calibrate=False).static_bytes[0])
        theirs = float(build_problem(profile, row_knobs, calibrate=False).static_bytes[0])
        expected = lift[("compiled", micro_batch, min(accum, 2))] + mine - theirs
        p = build_problem(profile, knobs)
        where = f"seed {seed} accum {accum}"
        assert p.offload is not None and p.offload.floor_bytes == pytest.approx(expected, rel=1e-12), where
        assert any("offload" in n and "peaks at no less than" in n for n in p.notes), where
        groups = p.groups()
        sixteen = np.array([next(i for i in idx if p.option[i] == "16") for _, idx in sorted(groups.items())])
        none = np.zeros(layers, dtype=bool)
        kept = p.evaluate(sixteen, none)
        off = p.evaluate(sixteen, none, np.arange(layers) == 0)
        assert max(off["peak_bytes_per_stage"]) >= expected - 1, where
        assert max(kept["peak_bytes_per_stage"]) == max(p.evaluate(sixteen, none, none)["peak_bytes_per_stage"])
        # a budget under the floor: whatever the solver returns keeps every layer on the GPU
        budget = expected * rng.uniform(0.9, 0.999)
        try:
            alloc = Solver(p).solve(budget, "time")
        except InfeasibleBudget:
            continue
        assert not alloc.offloaded().any() and max(alloc.peak_bytes_per_stage) <= budget + 1, where


def test_an_eager_offloading_step_that_ranged_is_noted(tmp_path):
    """An eager offloading row whose passes (or steps) ranged more than 5 % is named in the problem's notes with its
    range; one that did not, and a compiled one, are not."""
    from agoq.search.costs import EAGER_SPREAD_NOTE

    seed, rng = fresh_rng()
    layers, micro_batch = rng.choice([3, 5]), rng.choice([2, 4])
    profile = profile_with_offload_rows(tmp_path, rng, layers=layers, micro_batch=micro_batch,
                                        delta=lambda r: rng.uniform(0.001, 0.01))
    header = json.loads((profile.path / "profile.json").read_text())
    wide = 1 + EAGER_SPREAD_NOTE + rng.uniform(0.01, 0.3)
    for r in header["measured_steps"]["rows"]:
        if r.get("offload_layers"):
            r.pop("seconds_per_step", None)
            slow = r["step_seconds"] * (wide if (r["compile"], r["grad_accum"]) == ("eager", 1) else 1.02)
            r["repeat_step_seconds"] = [r["step_seconds"], slow]
    (profile.path / "profile.json").write_text(json.dumps(header))
    profile = load_profile(profile.path)
    for mode in ("eager", "compiled"):
        for accum in (1, 2):
            notes = build_problem(profile, ProblemSettings(compile_mode=mode, micro_batch=micro_batch,
                                                           grad_accum=accum)).notes
            found = [n for n in notes if "offloading step" in n and "apart" in n]
            if mode == "compiled":
                assert not found, (seed, mode, accum, found)
                continue
            assert len(found) == 1 and f"micro-batch {micro_batch} x 1 " in found[0], (seed, accum, found)
            assert f"({wide - 1:.0%} apart)" in found[0], (seed, found)


def test_an_offloaded_layers_backward_is_priced_from_the_measured_offloading_step(tmp_path):
    """What an offloaded layer's backward allocates (OffloadPrices.backward_bytes) is the offloading step's measured
    peak less the calibrated model's level in the backward of its offloaded layers 0 and 1, plus that peak's spread:
    its passes' (repeat_peak_bytes), at least OFFLOAD_SPREAD_FLOOR of it. The model then puts the measured step itself
    at its peak plus the spread (and the margin every compiled plan carries); a measured peak moved by X moves it by
    X and the floor's share of X; a measured peak under the level leaves the spread alone."""
    import numpy as np

    from agoq.search import calibration
    from agoq.search.calibration import OFFLOAD_SPREAD_FLOOR

    seed, rng = fresh_rng()
    layers, micro_batch = rng.choice([3, 5, 7]), rng.choice([2, 4, 6])
    profile = profile_with_offload_rows(tmp_path, rng, layers=layers, micro_batch=micro_batch,
                                        delta=lambda r: 0.005, offloaded_bytes=10**6)
    row = prices(profile).offload_row("compiled", micro_batch, 1)
    knobs = ProblemSettings(compile_mode="compiled", micro_batch=micro_batch, grad_accum=1)

    def priced(peak, passes=None):
        row["peak_bytes"] = int(peak)
        if passes is None:
            row.pop("repeat_peak_bytes", None)
        else:
            row["repeat_peak_bytes"] = [int(v) for v in passes]
        for key in [k for k in profile.cache if k != "step_prices"]:  # the row as changed, priced again
            del profile.cache[key]
        p = build_problem(profile, knobs)
        return p, p.offload.backward_bytes

    p, _ = priced(1)  # (a synthetic profile's steps have no peaks: each is given one)
    chosen = calibration._choice(p, "agoq-paper")[0]
    prefix = np.arange(layers) < row["offload_layers"]
    margin = float(p.static_parts.get("margin", [0.0])[0])
    level = float(p._memory(chosen, np.zeros(layers, dtype=bool), prefix)["level_at_offloaded"][0]) - margin
    where = f"seed {seed}"
    for peak in (level + rng.uniform(1e6, 1e8), level + rng.uniform(1e6, 1e8)):
        p, d = priced(peak)
        assert d == pytest.approx(peak - level + OFFLOAD_SPREAD_FLOOR * int(peak), abs=2.0), where
        m = p._memory(chosen, np.zeros(layers, dtype=bool), prefix)
        assert float(m["level_at_offloaded"][0]) + d - margin == pytest.approx(
            int(peak) * (1 + OFFLOAD_SPREAD_FLOOR), abs=2.0), where
        assert any("offloaded layer's backward allocates" in n for n in p.notes), where
    spread = rng.uniform(0.02, 0.05) * peak
    _, d = priced(peak, passes=[peak - spread, peak])
    assert d == pytest.approx(peak - level + int(spread), abs=2.0), where
    _, d = priced(level * rng.uniform(0.5, 0.95))  # under the model's level: nothing allocated, the spread kept
    assert d == pytest.approx(OFFLOAD_SPREAD_FLOOR * int(row["peak_bytes"]), abs=2.0), where


def test_a_malformed_pass_peak_list_is_refused_naming_the_field(tmp_path):
    """`repeat_peak_bytes` is each pass's peak in bytes: a profile giving something else (text, a negative number,
    an empty list, not a list) is refused with an error naming the row and the field."""
    seed, rng = fresh_rng()
    for i, bad in enumerate(["10 GB", [1.5e9, -3], [], 7, [True]]):
        profile = profile_with_offload_rows(tmp_path / f"p{i}", rng, layers=3, micro_batch=2,
                                            delta=lambda r: 0.005, offloaded_bytes=10**6)
        header = json.loads((profile.path / "profile.json").read_text())
        row = rng.randrange(len(header["measured_steps"]["rows"]))
        header["measured_steps"]["rows"][row]["repeat_peak_bytes"] = bad
        (profile.path / "profile.json").write_text(json.dumps(header))
        with pytest.raises(ValueError, match=rf"rows\[{row}\]\.repeat_peak_bytes: must be a list"):
            prices(load_profile(profile.path))
