"""`agoq profile`'s measured steps (agoq.commands.profile_steps): which kinds of step it measures, that each is run
by agoq train's own code, and that the search plans only from what was measured."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agoq.cli import main
from agoq.commands.profile_steps import measure_profile_steps, step_kinds
from agoq.formats.measured_steps import POLICIES, measured_rows
from agoq.formats.profile import load_profile
from agoq.search.costs import compile_modes

ARGS = ["profile", "llama-tiny", "--device", "cpu", "--seq-len", "29", "--micro-batch", "2", "--bits", "4",
        "--formats", "int", "--batches", "1", "--quiet", "--measured-steps", "2"]


@pytest.fixture(autouse=True)
def no_layout_steps(monkeypatch):
    """These tests are of the one-rank measured steps: the one-rank FSDP2 layout steps a one-GPU profile also takes
    (one spawned process; tests/commands/test_profile_layouts.py tests them) are left out, to keep the tests fast."""
    from agoq.commands import profile_layouts

    monkeypatch.setattr(profile_layouts, "measure_layout_steps", lambda world_size, **kw: ([], []))


@pytest.mark.parametrize("micro_batch", [1, 2, 6])
def test_step_kinds_are_every_split_policy_and_knob(micro_batch):
    kinds = step_kinds(micro_batch, ["eager", "compiled"])
    keys = [tuple(sorted(k.items())) for k in kinds]
    assert len(keys) == len(set(keys))
    divisors = [m for m in range(1, micro_batch + 1) if micro_batch % m == 0]
    for mode in ("eager", "compiled"):
        mine = [k for k in kinds if k["compile"] == mode]
        for m in divisors:
            for accum in (1, 2):
                at = [k for k in mine if (k["micro_batch"], k["grad_accum"]) == (m, accum)]
                base = [k for k in at if (k["gradients"], k["optimizer"], k["master"]) == ("bf16", "adamw8bit", "fp32")
                        and k["activation_memory_budget"] is None]
                assert sorted(k["policy"] for k in base) == sorted(POLICIES)
                assert [k["policy"] for k in at if k["gradients"] == "quangrad8"] == ["bf16"]
        others = {(k["optimizer"], k["master"]) for k in mine if k["micro_batch"] == micro_batch}
        assert others == {("adamw8bit", "fp32"), ("adamw", "fp32"), ("adamw8bit", "none")}
        budgets = sorted(k["activation_memory_budget"] for k in mine if k["activation_memory_budget"])
        assert budgets == ([0.1, 0.5] if mode == "compiled" else [])
    assert len(kinds) == 2 * (len(divisors) * 2 * 4 + 2) + 2


def test_a_failing_kind_is_a_failure_and_the_others_are_rows():
    calls = []

    def measure(cfg):
        calls.append(cfg)
        if cfg.memory.checkpoint_all and cfg.data.micro_batch == 1:
            raise RuntimeError("CUDA out of memory (pretend)")
        return SimpleNamespace(median_seconds=0.01 * cfg.data.grad_accum, max_peak_bytes=None, first_peak_bytes=None,
                               seconds=[0.5, 0.01])

    rows, failures, notes = measure_profile_steps("llama-tiny", layers=None, seq_len=29, micro_batch=2,
                                                  dtype="fp32", device="cpu", compile_modes=["eager"], steps=2,
                                                  repeats=2, progress=False, measure=measure)
    # the second pass does not try the failed kinds again
    assert len(calls) == 2 * len(step_kinds(2, ["eager"])) - 2 and not notes
    assert len(failures) == 2 and all("out of memory" in f["error"] for f in failures)
    assert len(rows) == len(step_kinds(2, ["eager"])) - 2
    assert all(r["source"] == "profile" and r["steps"] == 2 for r in rows)
    paper = [c for c in calls if c.memory.policy == "agoq-paper"]
    assert paper and all(not c.model.compile for c in calls)


def test_repeats_alternate_the_order_and_keep_the_least_median(seed):
    """Each kind is measured once per pass, the passes in opposite orders; the row keeps the pass with the least
    median (its per-step seconds too), the largest peak of any pass, and every pass's median and peak; kinds whose passes
    differ by more than SPREAD_WARNING come back as notes."""
    import random
    import statistics

    from agoq.commands.profile_steps import SPREAD_WARNING

    rng = random.Random(seed)
    kinds = step_kinds(2, ["eager"])
    order, figures = [], {}

    def measure(cfg):
        k = _kind_key(cfg)
        order.append(k)
        seconds = [rng.uniform(0.5, 2.0)] + [rng.uniform(0.01, 0.2) for _ in range(4)]
        peaks = [rng.randrange(10**6, 10**9) for _ in range(5)]
        f = SimpleNamespace(seconds=seconds, median_seconds=statistics.median(seconds[1:]), max_peak_bytes=max(peaks),
                            first_peak_bytes=peaks[0])
        figures.setdefault(k, []).append(f)
        return f

    rows, failures, notes = measure_profile_steps("llama-tiny", layers=None, seq_len=29, micro_batch=2, dtype="fp32",
                                                  device="cpu", compile_modes=["eager"], steps=5, repeats=3,
                                                  progress=False, measure=measure)
    n = len(kinds)
    assert not failures and len(rows) == n and len(order) == 3 * n
    assert order[n:2 * n] == order[:n][::-1] and order[2 * n:] == order[:n]
    noted = 0
    for row, first in zip(rows, order[:n]):
        passes = figures[first]
        medians = [f.median_seconds for f in passes]
        assert row["repeat_step_seconds"] == medians
        assert row["step_seconds"] == min(medians)
        assert row["seconds_per_step"] == passes[medians.index(min(medians))].seconds
        assert row["peak_bytes"] == max(f.max_peak_bytes for f in passes)
        assert row["repeat_peak_bytes"] == [f.max_peak_bytes for f in passes]
        assert row["first_step_peak_bytes"] == max(f.first_peak_bytes for f in passes)
        noted += max(medians) > (1 + SPREAD_WARNING) * min(medians)
    assert len(notes) == noted


def test_compiled_kinds_take_their_own_number_of_passes(seed):
    """With compiled_repeats C below repeats R, each compiled kind is measured C times and each eager kind R times:
    the passes after the C-th skip the compiled kinds and keep the eager ones' order (reversed in odd passes); a
    row keeps the least of its kind's medians, with the repeat lists only where it was measured more than once."""
    import random
    import statistics

    rng = random.Random(seed)
    repeats, compiled_repeats = rng.choice([(2, 1), (3, 1), (3, 2)])
    kinds = step_kinds(2, ["eager", "compiled"])
    order, figures = [], {}

    def measure(cfg):
        k = (*_kind_key(cfg), bool(cfg.model.compile), cfg.model.activation_memory_budget, cfg.memory.offload)
        order.append(k)
        seconds = [rng.uniform(0.5, 2.0)] + [rng.uniform(0.01, 0.2) for _ in range(3)]
        f = SimpleNamespace(seconds=seconds, median_seconds=statistics.median(seconds[1:]),
                            max_peak_bytes=rng.randrange(10**6, 10**9), first_peak_bytes=rng.randrange(10**6, 10**9))
        figures.setdefault(k, []).append(f)
        return f

    rows, failures, _ = measure_profile_steps("llama-tiny", layers=None, seq_len=17, micro_batch=2, dtype="fp32",
                                              device="cpu", compile_modes=["eager", "compiled"], steps=4,
                                              repeats=repeats, compiled_repeats=compiled_repeats, progress=False,
                                              measure=measure)
    compiled = [k["compile"] == "compiled" for k in kinds]
    n = len(kinds)
    first = order[:n]
    assert not failures and len(rows) == n and len(set(first)) == n
    passes = [compiled_repeats if c else repeats for c in compiled]
    assert len(order) == sum(passes)
    expected = []  # the order of every pass after the first: alternately reversed, kinds past their passes left out
    for r in range(1, repeats):
        pass_order = range(n) if r % 2 == 0 else range(n - 1, -1, -1)
        expected += [first[i] for i in pass_order if r < passes[i]]
    assert order[n:] == expected
    for row, key, p in zip(rows, first, passes):
        medians = [f.median_seconds for f in figures[key]]
        assert len(medians) == p
        assert row["step_seconds"] == min(medians)
        assert ("repeat_step_seconds" in row) == (p > 1)


@pytest.fixture()
def fast_compile(monkeypatch):
    """Each decoder layer compiled with the aot_eager backend: the same graphs as Inductor's input, in seconds."""
    from agoq.runtime.activations import compile as compile_module
    from agoq.train import apply

    real = compile_module.compile_decoder_layers
    monkeypatch.setattr(apply, "compile_decoder_layers", lambda model, **kw: real(model, backend="aot_eager", **kw))


def test_compile_measures_compiled_steps_and_the_search_plans_compiled(tmp_path, fast_compile):
    from agoq.search.knobs import KnobSpace
    from agoq.search.search import search

    assert main([*ARGS, "--out", str(tmp_path / "p"), "--compile"]) == 0
    header = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert not header["failures"], header["failures"]
    rows = measured_rows(header)
    assert len(rows) == len(step_kinds(2, ["eager", "compiled"]))
    assert all(r["step_seconds"] > 0 and r["peak_bytes"] is None for r in rows)  # no allocator peaks on the CPU
    profile = load_profile(tmp_path / "p")
    assert compile_modes(profile) == ["eager", "compiled"]
    budget = 10**9
    plan = search(profile, budget, front_budgets=0, progress=False, space=KnobSpace(compile_modes=("compiled",))).plan
    assert plan.training.compile == "compiled" and max(plan.predicted.peak_bytes_per_stage) <= budget


def test_no_measured_steps_and_nothing_is_offered(tmp_path, capsys):
    assert main([*ARGS[:-2], "--measured-steps", "0", "--out", str(tmp_path / "a")]) == 0
    header = json.loads((tmp_path / "a" / "profile.json").read_text())
    assert "measured_steps" not in header
    # the profiler's own memory steps (eager, the profiled split) still price that one split
    rows = measured_rows(header)
    assert {(r["compile"], r["micro_batch"], r["grad_accum"]) for r in rows} == {("eager", 2, 1)}
    capsys.readouterr()
    assert main(["search", "--profile", str(tmp_path / "a"), "--budget", "1GB", "--out", str(tmp_path / "s.json"),
                 "--micro-batch", "1", "--quiet"]) == 2
    assert "measured no eager step at micro-batch 1" in capsys.readouterr().err

@pytest.mark.parametrize("micro_batch,layers", [(1, 1), (2, 3), (6, 7)])
def test_offloading_kinds_run_the_runtime_offload_and_keep_their_bytes(micro_batch, layers):
    """With the host link measured, each compile mode adds agoq-paper with the first K layers offloaded at every
    micro-batch, with one and two per step, run by agoq train's own --offload; their rows carry K and the bytes the run
    offloaded per micro-batch, and read back beside the kept rows of the same knobs (a key of their own)."""
    import random

    rng = random.Random(micro_batch * 100 + layers)
    k = max(1, layers - 1)
    plain = step_kinds(micro_batch, ["eager", "compiled"])
    kinds = step_kinds(micro_batch, ["eager", "compiled"], offload_layers=k)
    extra = [x for x in kinds if x.get("offload_layers")]
    divisors = sorted(m for m in range(1, micro_batch + 1) if micro_batch % m == 0)
    assert len(kinds) == len(plain) + len(extra)
    for mode in ("eager", "compiled"):
        mine = [x for x in extra if x["compile"] == mode]
        assert sorted((x["micro_batch"], x["grad_accum"]) for x in mine) == [(m, a) for m in divisors for a in (1, 2)]
        assert all((x["policy"], x["offload_layers"]) == ("agoq-paper", k) for x in mine)
    moved = {}

    def measure(cfg):
        b = rng.randrange(1, 10**9) if cfg.memory.offload else None
        moved[(cfg.model.compile, cfg.data.micro_batch, cfg.data.grad_accum, cfg.memory.offload)] = b
        return SimpleNamespace(median_seconds=rng.uniform(0.01, 0.1), max_peak_bytes=None, first_peak_bytes=None,
                               seconds=[0.5, 0.01, 0.02], offloaded_bytes=b)

    rows, failures, _ = measure_profile_steps("llama-tiny", layers=None, seq_len=29, micro_batch=micro_batch,
                                              dtype="fp32", device="cpu", compile_modes=["eager"], steps=3,
                                              progress=False, offload_layers=k, measure=measure)
    assert not failures
    offloading = [r for r in rows if r.get("offload_layers")]
    assert sorted((r["micro_batch"], r["grad_accum"]) for r in offloading) == [(m, a) for m in divisors for a in (1, 2)]
    for r in offloading:
        assert r["offloaded_bytes"] == moved[(False, r["micro_batch"], r["grad_accum"], f"0-{k - 1}")]
    assert all("offload_layers" not in r and "offloaded_bytes" not in r for r in rows if r not in offloading)
    back = measured_rows({"measured_steps": {"version": 2, "rows": rows}})
    assert len(back) == len(rows)  # an offloading row does not replace the kept row of the same knobs
    with pytest.raises(ValueError, match="offloaded_bytes"):
        measured_rows({"measured_steps": {"version": 2, "rows": [{**offloading[0], "offloaded_bytes": None}]}})
    with pytest.raises(ValueError, match="newer than this agoq reads"):
        measured_rows({"measured_steps": {"version": 3, "rows": rows}})


def _kind_key(cfg) -> tuple:
    """The knobs that tell one kind of measured step from another, read from its TrainConfig."""
    return (cfg.memory.policy, cfg.memory.checkpoint_all, cfg.data.micro_batch, cfg.data.grad_accum,
            cfg.memory.gradients, cfg.optim.optimizer, cfg.optim.master)


class _Stopped(BaseException):
    """A stop the process does not survive (a lost machine, a time limit): not one kind's failure."""


def _figures_of(cfg, r, rng_seed):
    """Made-up figures of one pass of one kind, a function of the kind and the pass only."""
    import random

    from agoq.train.measure import StepFigures

    rng = random.Random(str((*_kind_key(cfg), r, rng_seed)))
    seconds = [rng.uniform(0.2, 0.9)] + [rng.uniform(0.01, 0.05) for _ in range(3)]
    return StepFigures(losses=[rng.uniform(1, 5) for _ in seconds], seconds=seconds,
                       peak_bytes=[rng.randrange(10**6, 10**9) for _ in seconds], device="cpu")


def _measure(calls, seed, stop_after=None, fail=(), seen=None):
    """A stand-in for measure_steps that numbers the passes of each kind (in `seen`, shared by the processes of one
    profile), fails the kinds in `fail` and stops the process after `stop_after` calls."""
    seen = {} if seen is None else seen

    def measure(cfg):
        if stop_after is not None and len(calls) == stop_after:
            raise _Stopped()
        calls.append(cfg)
        key = _kind_key(cfg)
        if (cfg.memory.checkpoint_all, cfg.data.micro_batch, cfg.data.grad_accum) in fail:
            raise RuntimeError("CUDA out of memory (pretend)")
        seen[key] = seen.get(key, -1) + 1
        return _figures_of(cfg, seen[key], seed)
    return measure


def test_a_stopped_profile_resumes_from_its_journal(tmp_path, seed):
    """Steps measured before a stop are read back from the journal and not measured again; the rows are those of a
    run that never stopped (the same figures per kind and pass), failures included; a last line cut short and the
    lines of another request are skipped."""
    import random

    rng = random.Random(seed)
    common = dict(layers=None, seq_len=29, micro_batch=2, dtype="fp32", device="cpu", compile_modes=["eager"],
                  steps=4, repeats=2, progress=False)
    total = 2 * len(step_kinds(2, ["eager"]))
    fail = {(True, 1, 2)}  # one kind fails: measured once, not again in the second pass
    whole_calls = []
    whole = measure_profile_steps("llama-tiny", **common, measure=_measure(whole_calls, seed, fail=fail))

    journal = tmp_path / "journal.jsonl"
    # lines of another request (another sequence length) are in the journal already
    other = []
    measure_profile_steps("llama-tiny", **{**common, "seq_len": 31}, journal=journal,
                          measure=_measure(other, seed + 1))
    before = journal.read_text()
    stop = rng.randrange(3, total - 3)
    first, seen = [], {}
    with pytest.raises(_Stopped):
        measure_profile_steps("llama-tiny", **common, journal=journal, measure=_measure(first, seed, stop, fail, seen))
    assert len(journal.read_text().splitlines()) == len(before.splitlines()) + stop
    with open(journal, "a") as f:  # the stop cut the next line short
        f.write('{"request": {"model": "llama-tiny"')
    second = []
    resumed = measure_profile_steps("llama-tiny", **common, journal=journal,
                                    measure=_measure(second, seed, None, fail, seen))
    assert len(first) + len(second) == len(whole_calls) == total - 1
    measured = {_kind_key(c) for c in second}
    assert len(measured) >= 1
    assert json.dumps(resumed, sort_keys=True) == json.dumps(whole, sort_keys=True)


def test_profile_resume_keeps_the_profile_and_its_measured_steps(tmp_path, monkeypatch, capsys):
    """`agoq profile --resume` after a stop in the measured steps: profile.json is kept as it was (not made again),
    only the missing steps are measured, the journal is gone once the steps are written; --resume with other flags
    is refused (exit 2, naming the setting); without --resume a stopped profile's folder is refused (exit 2) and kept
    as it was, and once complete the folder's profile is made again with --force (refused without it)."""
    import agoq.profiler.profile as profiler
    import agoq.train.measure as train_measure
    from agoq.commands.profile_steps import JOURNAL_NAME as JOURNAL

    out = tmp_path / "p"
    calls = []
    monkeypatch.setattr(train_measure, "measure_steps", _measure(calls, 7, stop_after=5))
    with pytest.raises(_Stopped):
        main([*ARGS, "--out", str(out)])
    header = json.loads((out / "profile.json").read_text())
    assert "measured_steps" not in header and len((out / JOURNAL).read_text().splitlines()) == 5
    capsys.readouterr()
    assert main([*ARGS, "--out", str(out)]) == 2  # without --resume: refused, and nothing measured is lost
    err = capsys.readouterr().err
    assert "--resume" in err and JOURNAL in err and len((out / JOURNAL).read_text().splitlines()) == 5
    assert json.loads((out / "profile.json").read_text()) == header

    def made_again(*a, **k):
        raise AssertionError("--resume made the profile again")

    real_make = profiler.make_profile
    monkeypatch.setattr(profiler, "make_profile", made_again)
    more = []
    monkeypatch.setattr(train_measure, "measure_steps", _measure(more, 7))
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    assert len(more) == len(step_kinds(2, ["eager"])) - 5
    resumed = json.loads((out / "profile.json").read_text())
    assert resumed["date"] == header["date"] and resumed["model"] == header["model"]
    assert len(measured_rows(resumed, "p")) == len(step_kinds(2, ["eager"])) and not (out / JOURNAL).exists()
    # resumed again: complete, nothing measured
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0 and len(more) == len(step_kinds(2, ["eager"])) - 5
    capsys.readouterr()

    real_hardware = profiler.hardware
    monkeypatch.setattr(profiler, "hardware", lambda *a: {**real_hardware(*a), "name": "another device"})
    assert main([*ARGS, "--out", str(out), "--resume"]) == 2
    assert "hardware" in capsys.readouterr().err and len(more) == len(step_kinds(2, ["eager"])) - 5
    monkeypatch.setattr(profiler, "hardware", real_hardware)
    args = [a if a != "29" else "31" for a in ARGS]
    assert main([*args, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "seq_len: 29 there, 31 now" in err and "--resume" in err
    monkeypatch.setattr(profiler, "make_profile", real_make)
    assert main([*args, "--out", str(out)]) == 2  # a finished profile is replaced only with --force
    assert "already holds a profile" in capsys.readouterr().err
    assert main([*args, "--out", str(out), "--force"]) == 0
    assert json.loads((out / "profile.json").read_text())["settings"]["seq_len"] == 31
