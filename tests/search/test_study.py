"""The Optuna study (agoq.search.study) run over every knob value it can draw: on the default llama-tiny profile
(`agoq profile llama-tiny --device cpu`: int and nf4 rows, bf16 and QuanGrad gradients) and on a two-rank
profile (every layout), with each optimizer / masters / compile mode a trial can take from its base knobs. Each
trial must complete, and the options its problem offers must be the profile table's rows of the trial's format
and floors (read here straight off the table)."""

from __future__ import annotations

import math
import os
import random

import optuna
import pytest

from agoq.runtime.activations.policy import KINDS
from agoq.cli import main
from agoq.formats.profile import load_profile
from agoq.search.costs import ProblemSettings, build_problem, compile_modes, optimizer_choices
from agoq.search.layouts import resolve_layout
from agoq.search.milp import Solver
from agoq.search.study import KnobSpace, run_study
from tests.search.synthetic_profile import write_profile


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """The profile `agoq profile llama-tiny --device cpu` writes (every default), made once for this module."""
    out = tmp_path_factory.mktemp("tiny") / "profile"
    assert main(["profile", "llama-tiny", "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    return load_profile(out)


@pytest.fixture(scope="module")
def two_rank_profile(tmp_path_factory):
    """A two-rank llama-tiny profile whose collectives table offers every layout (replicated, fsdp)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print("two-rank profile seed", seed)
    folder = write_profile(tmp_path_factory.mktemp("ranks") / "profile", random.Random(seed), world_size=2,
                           collectives=True, fsdp_collectives=True, micro_batch=3, seq_len=29)
    return load_profile(folder)


def _covering_trials(space: KnobSpace) -> list[dict]:
    """Trial parameters that between them take every value of every knob the space draws: each (format, gradient
    storage, layout) at least once, block, micro-batch, stage shift and each kind's floor cycling through theirs."""
    combos = [(f, m, lay) for f in space.formats for m in space.modes for lay in space.layouts]
    cycled = [space.blocks, space.micro_batches, space.floor_choices] + ([range(-2, 3)] if space.stages > 1 else [])
    n = max([len(combos)] + [len(c) for c in cycled])
    trials = []
    for i in range(n):
        fmt, mode, layout = combos[i % len(combos)]
        params = {**space.defaults(), "block": space.blocks[i % len(space.blocks)], "format": fmt,
                  "gradient_mode": mode, "micro_batch": space.micro_batches[i % len(space.micro_batches)]}
        params.update({f"floor_{k}": space.floor_choices[(i + j) % len(space.floor_choices)]
                       for j, k in enumerate(KINDS)})
        params.update({f"stage_shift_{s}": (i % 5) - 2 for s in range(1, space.stages)})
        if len(space.layouts) > 1:
            params["layout"] = layout
        trials.append(params)
    return trials


def _offered(profile, fmt: str, floors: dict) -> dict:
    """(layer, kind) -> {option: error} the profile table offers at `fmt` and `floors` (its sensitivity; 0 for
    recompute, which is exact): 16, recompute, every
    int width at or above the kind's floor, and at 4 bits the nf4 row instead of the int one under nf4."""
    out: dict = {}
    rows = profile.table.to_dict("records")
    nf4 = {(int(r["layer"]), r["kind"]) for r in rows if r["format"] == "nf4"}
    for r in rows:
        key, option = (int(r["layer"]), r["kind"]), str(r["option"])
        if r["format"] == "nf4" and fmt != "nf4":
            continue
        if r["format"] == "int" and fmt == "nf4" and option == "4" and key in nf4:
            continue
        if option not in ("16", "recompute") and int(option) < floors[r["kind"]]:
            continue
        out.setdefault(key, {})[option] = 0.0 if option == "recompute" else float(r["sensitivity"])  # exact
    return out


def _run_every_value(profile, tmp_path):
    """Run one study per base (optimizer, masters, compile mode) over the covering trials; check each trial."""
    default = build_problem(profile)
    solver = Solver(default)
    low, high = solver.smallest_budget(), max(solver.solve(math.inf).peak_bytes_per_stage)
    budget = int(low + 0.4 * (high - low))
    drawn: dict = {}
    space = KnobSpace(profile)
    bases = [ProblemSettings(optimizer=o, master=m, compile_mode=c) for c in compile_modes(profile)
             for o, m in optimizer_choices("bf16")]
    for n, base in enumerate(bases):
        storage = f"sqlite:///{tmp_path / 'study.db'}"
        name = f"every-value-{n}"
        study = optuna.create_study(study_name=name, storage=storage, directions=["minimize"] * 3)
        trials = _covering_trials(KnobSpace(profile, base=base))
        for params in trials:
            study.enqueue_trial(params)
        result = run_study(profile, budget, storage=storage, study_name=name, trials=len(trials), base=base,
                           progress=False)
        assert result.ran == len(trials)
        assert [t.state.name for t in result.study.trials] == ["COMPLETE"] * len(trials)
        for params, r in zip(trials, result.trials):
            k = r.knobs
            assert (k.block, k.format, k.gradient_mode, k.micro_batch) == \
                (params["block"], params["format"], params["gradient_mode"], params["micro_batch"])
            assert k.micro_batch * k.grad_accum == space.sequences
            assert dict(k.floor_bits) == {kind: params[f"floor_{kind}"] for kind in KINDS}
            wanted = params.get("layout", space.layouts[0])
            assert k.layout == (wanted if _takes(k.gradient_mode, wanted) else resolve_layout(None, k.gradient_mode))
            own = optimizer_choices(k.gradient_mode, k.layout)
            assert (k.optimizer, k.master) == ((base.optimizer, base.master) if (base.optimizer, base.master) in own
                                               else own[0])
            assert k.compile_mode == base.compile_mode
            want = _offered(profile, k.format, dict(k.floor_bits))
            got: dict = {}
            for i, option in enumerate(r.problem.option):
                got.setdefault((int(r.problem.layer[i]), KINDS[int(r.problem.kind[i])]), {})[option] = \
                    float(r.problem.error[i])
            assert got == want, (params, base)
            assert r.values[0] == max(r.alloc.peak_bytes_per_stage) and math.isfinite(r.values[1])
            assert r.feasible == (r.values[0] <= budget)
            for name_, value in [("block", k.block), ("format", k.format), ("gradient_mode", k.gradient_mode),
                                 ("micro_batch", k.micro_batch), ("layout", k.layout),
                                 ("optimizer", (k.optimizer, k.master)), ("compile_mode", k.compile_mode)]:
                drawn.setdefault(name_, set()).add(value)
            for kind, bits in k.floor_bits:
                drawn.setdefault(f"floor_{kind}", set()).add(bits)
    return space, drawn


def _takes(mode: str, layout: str) -> bool:
    try:
        resolve_layout(layout, mode)
        return True
    except ValueError:
        return False


def test_every_knob_value_on_the_default_tiny_profile(tiny_profile, tmp_path):
    space, drawn = _run_every_value(tiny_profile, tmp_path)
    table = tiny_profile.table
    # the space is what the profile holds: nf4 rows, QuanGrad's bytes, int widths, a micro-batch of 2
    assert set(table["format"]) >= {"int", "nf4"} and drawn["format"] == {"int", "nf4"}
    assert drawn["gradient_mode"] == {"bf16", "quangrad8"}
    assert drawn["block"] == {32, 64, 128, 256}
    assert drawn["micro_batch"] == {1, 2}
    assert drawn["layout"] == {"replicated"}
    assert drawn["optimizer"] == {("adamw", "fp32"), ("adamw8bit", "fp32"), ("adamw8bit", "none")}
    assert drawn["compile_mode"] == {"eager"}
    widths = sorted({int(o) for o in table["option"] if o not in ("16", "recompute")})
    for kind in KINDS:
        assert sorted(drawn[f"floor_{kind}"]) == widths


def test_every_knob_value_on_two_ranks(two_rank_profile, tmp_path):
    space, drawn = _run_every_value(two_rank_profile, tmp_path)
    assert drawn["gradient_mode"] == {"bf16", "quangrad8", "sdp4bit"}
    assert drawn["layout"] == {"replicated", "fsdp"}
    assert drawn["micro_batch"] == {1, 3}
    assert drawn["optimizer"] == {("adamw", "fp32"), ("adamw8bit", "fp32"), ("adamw8bit", "none")}
