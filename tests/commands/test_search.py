"""`agoq search` end to end: plan and Pareto front files, infeasible budgets, the Optuna study's storage and
resume, validation runs (here and as Ray tasks)."""

import csv
import math
import random
from pathlib import Path

import pytest

from agoq.cli import main
from agoq.formats.plan import load_plan
from agoq.formats.profile import load_profile
from agoq.models import build, fingerprint
from agoq.search.costs import ProblemSettings, build_problem
from agoq.search.milp import Solver
from agoq.search.search import search
from agoq.train.measure import measure_plan
from tests.search.synthetic_profile import write_profile


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


@pytest.fixture
def profile_dir(tmp_path):
    seed, rng = fresh_rng()
    return write_profile(tmp_path / "profile", rng, micro_batch=2, seq_len=40)


# the knobs of build_problem's defaults for these profiles and no error cap: the per-layer MILP alone, as these
# tests check it (the smallest budget and the front are those of one problem)
PIN = ["--gradients", "bf16", "--optimizer", "adamw8bit", "--master", "fp32", "--micro-batch", "2", "--error-cap", "none"]


def _bounds(folder):
    # as `agoq search` plans by default: attention kept at 16 bits (KnobSpace.quantize_attention)
    solver = Solver(build_problem(load_profile(folder), ProblemSettings(quantize_attention=False)))
    return solver.smallest_budget(), max(solver.solve(math.inf).peak_bytes_per_stage)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_milp_plan_and_front(profile_dir, tmp_path, capsys):
    low, high = _bounds(profile_dir)
    budget = (low + high) // 2
    out = tmp_path / "search" / "plan.json"
    assert main(["search", "--profile", str(profile_dir), "--budget", str(budget), "--out", str(out), "--quiet",
                 "--front-budgets", "9", *PIN]) == 0
    model = build("llama-tiny", device="meta")
    plan = load_plan(out, model)
    assert plan.model.fingerprint == fingerprint(model)
    assert plan.budget_bytes == budget and max(plan.predicted.peak_bytes_per_stage) <= budget
    assert plan.source.method == "milp"
    rows = _rows(tmp_path / "search" / "plan.pareto.csv")
    assert 1 <= len(rows) <= 9
    peaks = [int(r["predicted_peak_bytes"]) for r in rows]
    errors = [float(r["predicted_grad_error"]) for r in rows]
    times = [float(r["predicted_step_seconds"]) for r in rows]
    assert peaks == sorted(peaks) and peaks[0] == low
    for i in range(1, len(rows)):  # a front: more memory buys less error or less time
        assert errors[i] < errors[i - 1] or times[i] < times[i - 1]
    for r in rows:
        front_plan = load_plan(tmp_path / "search" / r["plan"], model)
        assert max(front_plan.predicted.peak_bytes_per_stage) == int(r["predicted_peak_bytes"])
    said = capsys.readouterr().out
    assert "wrote" in said and "profiled on cpu):" in said.splitlines()[0]  # the synthetic profile's device


def test_infeasible_budget_names_the_smallest(profile_dir, tmp_path, capsys):
    low, _ = _bounds(profile_dir)
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(profile_dir), "--budget", str(low - 1000), "--out", str(out),
                 "--quiet", *PIN]) == 2
    err = capsys.readouterr().err
    assert "smallest feasible budget" in err and str(low) in err
    assert not out.exists()
    assert main(["search", "--profile", str(profile_dir), "--budget", str(low), "--out", str(out), "--quiet",
                 "--front-budgets", "0", *PIN]) == 0
    assert max(load_plan(out).predicted.peak_bytes_per_stage) == low


def test_optimizer_step_peak_is_a_floor(tmp_path, capsys):
    """A profile whose optimizer step peaks above any activation choice: the smallest budget is that peak."""
    seed, rng = fresh_rng()
    probe = write_profile(tmp_path / "a", random.Random(seed))
    low, _ = _bounds(probe)
    memory = load_profile(probe).memory
    static = build_problem(load_profile(probe)).static_bytes[0] - memory["fixed_bytes"] \
        - memory["outside_activation_bytes"]
    opt_step = int(low - static) + rng.randrange(10**5, 10**6)
    folder = write_profile(tmp_path / "b", random.Random(seed), optimizer_step_bytes=opt_step)
    floor = int(static + opt_step)
    assert Solver(build_problem(load_profile(folder))).smallest_budget() == floor
    assert main(["search", "--profile", str(folder), "--budget", str(floor - 1), "--out", str(tmp_path / "p.json"),
                 "--quiet", *PIN]) == 2
    assert str(floor) in capsys.readouterr().err
    assert main(["search", "--profile", str(folder), "--budget", str(floor), "--out", str(tmp_path / "p.json"),
                 "--quiet", "--front-budgets", "0", *PIN]) == 0
    predicted = load_plan(tmp_path / "p.json").predicted
    assert predicted.peak_bytes_per_stage == [floor]
    # the layers' activations are what they keep, not the room the optimizer step leaves
    fixed = memory["fixed_bytes"] + memory["outside_activation_bytes"]
    assert 0 < predicted.activation_bytes_per_stage[0] <= floor - static - fixed


def test_bad_arguments(profile_dir, tmp_path, capsys):
    assert main(["search", "--profile", str(tmp_path / "absent"), "--budget", "1GiB", "--out",
                 str(tmp_path / "p.json")]) == 2
    assert "profile folder not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["search", "--profile", str(profile_dir), "--budget", "lots", "--out", str(tmp_path / "p.json")])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["search", "--profile", str(profile_dir), "--budget", "1GiB", "--time-cap", "-1",
              "--out", str(tmp_path / "p.json")])


def test_optuna_resumes_an_interrupted_study(profile_dir, tmp_path):
    """Run 3 trials and leave one hanging (as a killed process would), then run again asking for 7 in all:
    the hanging one is failed, exactly 4 more run, and the first trial is the MILP plan's knobs."""
    import optuna
    from optuna.trial import TrialState

    profile = load_profile(profile_dir)
    low, high = _bounds(profile_dir)
    budget = (low + high) // 2
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = search(profile, budget, method="optuna", trials=7, storage=storage, stop_after=3, progress=False,
                   front_budgets=0)
    assert first.trials_run == 3
    study = optuna.load_study(study_name="agoq-search", storage=storage)
    study.ask()  # a trial that was running when its process died
    second = search(profile, budget, method="optuna", trials=7, storage=storage, progress=False, front_budgets=0)
    assert second.trials_run == 4
    study = optuna.load_study(study_name="agoq-search", storage=storage)
    states = [t.state for t in study.trials]
    assert states.count(TrialState.COMPLETE) == 7 and states.count(TrialState.FAIL) == 1
    assert study.trials[0].params["block"] == profile.settings["block"]
    assert study.trials[0].params["gradient_mode"] == "bf16"
    third = search(profile, budget, method="optuna", trials=7, storage=storage, progress=False, front_budgets=0)
    assert third.trials_run == 0
    # every optuna plan on the front fits the budget
    assert second.candidates
    for c in second.candidates:
        assert max(c.plan.predicted.peak_bytes_per_stage) <= budget
    with pytest.raises(ValueError, match="another budget"):
        search(profile, budget + 1, method="optuna", trials=8, storage=storage, progress=False, front_budgets=0)


def test_command_both_with_journal_storage(profile_dir, tmp_path, capsys):
    low, high = _bounds(profile_dir)
    out = tmp_path / "s" / "plan.json"
    journal = tmp_path / "s" / "study.journal"
    args = ["search", "--profile", str(profile_dir), "--budget", str((low + high) // 2), "--out", str(out),
            "--quiet", "--trials", "6", "--storage", str(journal), "--sampler", "tpe", "--front-budgets", "4"]
    assert main(args) == 0
    assert journal.is_file()
    text = capsys.readouterr().out
    assert "6 trial(s) run now, 6 in the study" in text
    args[args.index("--trials") + 1] = "8"
    assert main(args) == 0
    assert "2 trial(s) run now, 8 in the study" in capsys.readouterr().out
    sources = {r["source"] for r in _rows(tmp_path / "s" / "plan.pareto.csv")}
    assert sources == {"milp-front", "optuna"}
    assert load_plan(out).source.method in ("milp", "optuna")


def test_validate_on_cpu(profile_dir, tmp_path, capsys):
    low, high = _bounds(profile_dir)
    out = tmp_path / "v" / "plan.json"
    assert main(["search", "--profile", str(profile_dir), "--budget", str((low + high) // 2), "--out", str(out),
                 "--quiet", "--validate", "2", "--validate-steps", "3", "--front-budgets", "3"]) == 0
    plan = load_plan(out)
    m = plan.measured
    assert m is not None and m.step_seconds > 0 and math.isfinite(m.loss_deviation)
    assert m.peak_bytes_per_stage == [None]  # not measurable on a CPU, and said so
    assert "not measured" in m.model_extra["note"]
    rows = _rows(tmp_path / "v" / "plan.pareto.csv")
    assert sum(1 for r in rows if r["measured_step_seconds"]) >= 1
    out, err = capsys.readouterr()
    assert "measured: peak not measured" in out
    assert "validating plans" not in err and "pareto budgets" not in err and "\r" not in err  # --quiet: no bars


def test_no_bars_in_a_log(profile_dir, tmp_path, capsys):
    """Without --quiet, on a stream that is not a terminal (pytest's capture, like a CI log), a search that ends
    within a minute writes no progress lines."""
    low, high = _bounds(profile_dir)
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(profile_dir), "--budget", str((low + 2 * high) // 3), "--out", str(out),
                 "--front-budgets", "5", "--method", "both", "--trials", "3", *PIN]) == 0
    err = capsys.readouterr().err
    assert "pareto budgets" not in err and "optuna trials" not in err and "\r" not in err, err


def test_validation_loss_deviation_is_zero_for_a_plain_plan(tmp_path):
    """A plan that keeps everything at 16 bits trains exactly like the plain model: deviation 0."""
    from agoq.formats.plan import Plan
    from agoq.search.validation import validate_plans

    model = build("llama-tiny", device="meta")
    plan = Plan(model={"name": "t", "fingerprint": fingerprint(model)}, layers=[{"layer": i} for i in range(3)],
                training={"micro_batch": 2, "seq_len": 21})
    quant = Plan(model={"name": "t", "fingerprint": fingerprint(model)},
                 layers=[{"layer": i, "kinds": {k: 2 for k in ("norm_input", "silu_input", "o_proj_input")}}
                         for i in range(3)], training={"micro_batch": 2, "seq_len": 21})
    validate_plans([plan, quant], model.config.to_dict(), measure=measure_plan, dtype="fp32", steps=3)
    assert plan.measured.loss_deviation == 0.0
    assert quant.measured.loss_deviation > 0.0


def test_validation_as_ray_tasks(profile_dir, tmp_path):
    ray = pytest.importorskip("ray")
    from agoq.search.validation import Runner

    try:
        runner = Runner("local")
    except Exception as e:  # no Ray on this machine (sandboxes without shared memory, ...)
        pytest.skip(f"Ray could not start locally: {e}")
    try:
        profile = load_profile(profile_dir)
        low, high = _bounds(profile_dir)
        out = search(profile, (low + high) // 2, method="milp", validate=1, validate_steps=2, progress=False,
                     front_budgets=0, ray_address="local", measure=measure_plan)
        m = out.plan.measured
        assert m.step_seconds > 0 and math.isfinite(m.loss_deviation)
        local = search(profile, (low + high) // 2, method="milp", validate=1, validate_steps=2, progress=False,
                       front_budgets=0, measure=measure_plan)
        # same seed, same data, same model: the losses, hence the deviation, do not depend on where it ran
        assert m.loss_deviation == pytest.approx(local.plan.measured.loss_deviation, rel=1e-6, abs=1e-9)
        assert runner.ray is ray
        # Optuna trials measured as Ray tasks, two at a time, in a journal-file study
        journal = str(tmp_path / "study.journal")
        res = search(profile, (low + high) // 2, method="optuna", trials=4, storage=journal, measure_trials=True,
                     parallel=2, ray_address="local", progress=False, front_budgets=0, validate_steps=2,
                     measure=measure_plan)
        assert res.trials_run == 4
        _check_measured_trials(journal, 4)
    finally:
        ray.shutdown()


def _check_measured_trials(storage, count):
    import optuna
    from optuna.trial import TrialState

    from agoq.search.study import open_storage

    study = optuna.load_study(study_name="agoq-search", storage=open_storage(storage))
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == count
    measured = [t for t in done if "measured" in t.user_attrs]
    assert measured, "no trial was measured"
    for t in measured:  # the study's time objective is the measured step time
        assert t.values[1] == t.user_attrs["measured"]["step_seconds"] > 0
        assert math.isfinite(t.user_attrs["measured"]["loss_deviation"])


def test_measured_trials_here(profile_dir, tmp_path):
    profile = load_profile(profile_dir)
    low, high = _bounds(profile_dir)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    res = search(profile, (low + high) // 2, method="optuna", trials=3, storage=storage, measure_trials=True,
                 progress=False, front_budgets=0, validate_steps=2, measure=measure_plan)
    assert res.trials_run == 3
    _check_measured_trials(storage, 3)


def test_on_a_real_profile(tmp_path):
    """`agoq profile` then `agoq search` at budgets across the range: every plan loads for the profiled model,
    fits its budget, and keeps exactly the activation bytes it predicts."""
    import torch

    import agoq
    from agoq.train.apply import apply_plan, remove_plan

    prof = tmp_path / "profile"
    assert main(["profile", "llama-tiny", "--layers", "2", "--seq-len", "24", "--batches", "1", "--bits", "3,4,8",
                 "--formats", "int", "--device", "cpu", "--out", str(prof), "--quiet"]) == 0
    profile = load_profile(prof)
    low, high = _bounds(prof)
    model = build("llama-tiny", num_layers=2, dtype=torch.float32)
    mb, seq = profile.settings["micro_batch"], profile.settings["seq_len"]
    ids = torch.randint(0, model.config.vocab_size, (mb, seq + 1))
    for frac in (0.0, 0.35, 0.7, 1.0):
        budget = int(low + frac * (high - low))
        out = tmp_path / f"s{frac}" / "plan.json"
        assert main(["search", "--profile", str(prof), "--budget", str(budget), "--out", str(out), "--quiet",
                     "--front-budgets", "3", "--gradients", "bf16", "--optimizer", "adamw8bit", "--micro-batch",
                     str(mb), "--error-cap", "none"]) == 0
        plan = load_plan(out, model)
        assert max(plan.predicted.peak_bytes_per_stage) <= budget
        apply_plan(model, policy=plan.activation_policy(), checkpoint=plan.checkpoint_layers())
        with agoq.track_saved_tensors(model) as log:
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        remove_plan(model)
        assert plan.predicted.activation_bytes_per_stage == [log.layer_total(0) + log.layer_total(1)], budget


def test_time_objective_under_an_error_cap(profile_dir, tmp_path):
    low, high = _bounds(profile_dir)
    budget = int(low + 0.3 * (high - low))
    fast = tmp_path / "fast.json"
    assert main(["search", "--profile", str(profile_dir), "--budget", str(budget), "--out", str(fast), "--quiet",
                 "--objective", "time", "--time-cap", "none", "--front-budgets", "0"]) == 0
    free = load_plan(fast).predicted
    cap = free.grad_error / 3
    capped = tmp_path / "capped.json"
    assert main(["search", "--profile", str(profile_dir), "--budget", str(budget), "--out", str(capped), "--quiet",
                 "--objective", "time", "--time-cap", "none", "--error-cap", str(cap), "--front-budgets", "0"]) == 0
    plan = load_plan(capped).predicted
    assert plan.grad_error <= cap * (1 + 1e-9)
    assert plan.step_seconds >= free.step_seconds  # the cap costs time (or nothing)
    assert max(plan.peak_bytes_per_stage) <= budget


def test_knob_space_stage_boundaries(tmp_path):
    """Stage boundaries move by the suggested shifts, and a shift that would empty a stage is refused."""
    import optuna

    from agoq.search.study import KnobSpace

    seed, rng = fresh_rng()
    profile = load_profile(write_profile(tmp_path / "p", rng, num_layers=7, stages=3, in_flight=[3, 2, 1]))
    space = KnobSpace(profile)
    base = profile.layer_stage()
    bounds = [base.index(s) for s in (1, 2)]
    for s1 in range(-2, 3):
        for s2 in range(-2, 3):
            params = {**space.defaults(), "stage_shift_1": s1, "stage_shift_2": s2}
            knobs = space.suggest(optuna.trial.FixedTrial(params))
            cut = [bounds[0] + s1, bounds[1] + s2]
            if 0 < cut[0] < cut[1] < 7:
                assert list(knobs.layer_stage) == [0] * cut[0] + [1] * (cut[1] - cut[0]) + [2] * (7 - cut[1])
            else:
                assert list(knobs.layer_stage) == base
            problem = build_problem(profile, knobs)  # a valid pipeline split builds
            assert problem.num_stages == 3


def test_killed_search_resumes(profile_dir, tmp_path, capsys):
    """SIGKILL an `agoq search` mid-study (trials measured, so each takes a while), then run it again: the
    study keeps the finished trials, fails the one that was running, and runs only the missing ones."""
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    import optuna
    from optuna.trial import TrialState

    low, high = _bounds(profile_dir)
    out = tmp_path / "s" / "plan.json"
    args = ["search", "--profile", str(profile_dir), "--budget", str((low + high) // 2), "--out", str(out),
            "--quiet", "--method", "optuna", "--measure-trials", "--validate-steps", "2", "--front-budgets", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "agoq.cli", *args, "--trials", "500"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = tmp_path / "s" / "plan.study.db"
    storage = f"sqlite:///{db}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            try:  # read-only peek (Optuna itself would try to create the schema the search is creating)
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                    done = con.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
            except sqlite3.Error:  # not created yet
                continue
            if done >= 3:
                break
        assert proc.poll() is None, f"the search ended by itself (exit code {proc.returncode})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    study = optuna.load_study(study_name="agoq-search", storage=storage)
    before = sum(t.state == TrialState.COMPLETE for t in study.trials)
    assert before >= 3, "the search did not get going"
    assert main(args + ["--trials", str(before + 2)]) == 0
    assert "2 trial(s) run now, " in capsys.readouterr().out
    study = optuna.load_study(study_name="agoq-search", storage=storage)
    states = [t.state for t in study.trials]
    assert states.count(TrialState.COMPLETE) == before + 2
    assert TrialState.RUNNING not in states


def test_error_cap_recipe_gives_the_fastest_plan_within_the_recipes_error(profile_dir, tmp_path, capsys):
    from agoq.search.costs import recipe_error

    low, high = _bounds(profile_dir)
    budget = int(low + 0.4 * (high - low))
    cap = recipe_error(build_problem(load_profile(profile_dir)))
    by_name, by_value = tmp_path / "recipe.json", tmp_path / "value.json"
    for out, value in ((by_name, "recipe"), (by_value, repr(cap))):
        assert main(["search", "--profile", str(profile_dir), "--budget", str(budget), "--out", str(out), "--quiet",
                     "--objective", "time", "--error-cap", value, "--front-budgets", "0", "--verbose"]) == 0
    a, b = load_plan(by_name), load_plan(by_value)
    assert a.predicted.grad_error <= cap * (1 + 1e-9)
    assert a.predicted.step_seconds == pytest.approx(b.predicted.step_seconds, rel=1e-9)
    printed = capsys.readouterr()
    said = f"error cap {cap:.4g}: the predicted gradient error of the published recipe"
    assert said in printed.out + printed.err  # --verbose prints every note
    assert any(n.startswith(said) for n in a.source.notes)  # and the plan keeps them


@pytest.mark.parametrize("bad", ["-0.5", "reciepe", "nan"])
def test_error_cap_rejects_bad_values(profile_dir, tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["search", "--profile", str(profile_dir), "--budget", "1GB", "--out", str(tmp_path / "p.json"),
              "--error-cap", bad])
    assert e.value.code != 0
    assert "--error-cap" in capsys.readouterr().err


def test_search_into_an_earlier_out_says_so_and_drops_the_old_front(profile_dir, tmp_path, capsys):
    low, high = _bounds(profile_dir)
    out = tmp_path / "s" / "plan.json"
    args = ["search", "--profile", str(profile_dir), "--out", str(out), "--quiet", "--front-budgets", "3"]
    assert main([*args, "--budget", str(high)]) == 0
    assert "replacing" not in capsys.readouterr().err
    stale = out.parent / "plan-pareto" / "optuna-07.json"  # a front plan of an earlier, larger search
    stale.parent.mkdir(exist_ok=True)
    stale.write_text("{}")
    mine = out.parent / "plan-pareto" / "notes.txt"
    mine.write_text("kept")
    assert main([*args, "--budget", str((low + high) // 2)]) == 0
    assert "replacing" in capsys.readouterr().err
    assert not stale.exists() and mine.read_text() == "kept"
    assert load_plan(out).budget_bytes == (low + high) // 2


def test_ranges_of_layers():
    """Sorted layer indices written as ranges read back as the same indices, on random sets."""
    from agoq.commands.search import _ranges

    seed, rng = fresh_rng()
    for trial in range(200):
        layers = sorted(rng.sample(range(37), rng.randint(1, 20)))
        back = []
        for part in _ranges(layers).split(", "):
            lo, _, hi = part.partition("-")
            back += list(range(int(lo), int(hi or lo) + 1))
        assert back == layers, f"seed {seed} trial {trial}"
        assert len(_ranges(layers).split(", ")) == 1 + sum(b != a + 1 for a, b in zip(layers, layers[1:]))


def test_an_offloading_plan_says_what_it_offloads(tmp_path, capsys):
    """From a profile that measured the host link, at a budget only offload fits, `agoq search` says which layers
    keep their saved tensors in host memory and how many bytes, and where the peak is set."""
    from agoq.units import format_bytes
    from tests.search.test_milp_offload import link_profile

    seed, rng = fresh_rng()
    folder, _, least, without = link_profile(tmp_path / "p", rng)
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(folder), "--budget", str((least + without) // 2), "--out", str(out),
                 "--quiet", "--front-budgets", "0", "--error-cap", "none"]) == 0
    plan = load_plan(out, build("llama-tiny", device="meta", num_layers=5))
    offloaded = plan.offload_layers()
    text = capsys.readouterr().out
    assert offloaded, f"seed {seed}"
    line = next(li for li in text.splitlines() if li.strip().startswith("offload:"))
    assert f"layers 0-{offloaded[-1]}" in line or (offloaded == [0] and "layers 0 " in line), f"seed {seed}: {line}"
    assert format_bytes(plan.predicted.host_bytes) in line
    assert "peak set at: " in text


H100_PROFILE = Path(__file__).resolve().parents[2] / "experiments" / "results" / "profiles" / "probe-h100-link"


@pytest.mark.skipif(not H100_PROFILE.exists(), reason="the committed H100 profile of the probe is not here")
def test_a_budget_just_under_a_much_faster_plan_says_so(tmp_path, capsys):
    """On the probe's H100 profile 9.92 GB fits only an eager plan; 2 % more fits a compiled one. `agoq search` names
    it, and searched at that budget on its own it is the plan the note describes; a budget with no such cliff above it
    (checked by searching 2 % above) gets no note."""
    from agoq.search.search import HEADROOM, MUCH_FASTER

    def searched(budget: int, name: str):
        out = tmp_path / name / "plan.json"
        assert main(["search", "--profile", str(H100_PROFILE), "--budget", str(budget), "--out", str(out), "--quiet",
                     "--front-budgets", "0"]) == 0
        plan = load_plan(out)
        speed = plan.training.micro_batch * plan.training.grad_accum * plan.training.seq_len / plan.predicted.step_seconds
        return plan, speed, capsys.readouterr().err

    budget = 9_920_000_000 + random.randrange(0, 10**7)
    tight, tight_speed, said = searched(budget, "tight")
    above, above_speed, _ = searched(int(budget * (1 + HEADROOM)), "above")
    assert tight.training.compile == "eager" and above.training.compile == "compiled"
    ratio = above_speed / tight_speed
    assert ratio >= MUCH_FASTER
    notes = [n for n in tight.source.notes if "larger" in n]
    assert len(notes) == 1 and notes[0] in said, said
    assert f"{ratio:.2f}x faster" in notes[0] and "compiled" in notes[0]
    assert f"{above.predicted.step_seconds * 1e3:.1f} ms a step against {tight.predicted.step_seconds * 1e3:.1f}" \
        in notes[0]
    roomy = 12_000_000_000 + random.randrange(0, 10**8)
    plan, speed, said = searched(roomy, "roomy")
    _, speed_above, _ = searched(int(roomy * (1 + HEADROOM)), "roomy-above")
    assert speed_above / speed < MUCH_FASTER
    assert not any("larger" in n for n in plan.source.notes) and "larger" not in said
