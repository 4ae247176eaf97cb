"""`agoq profile`'s multi-rank layout steps (agoq.commands.profile_layouts): each data-parallel layout run by agoq
train's own code on every rank, its figures agreed over the ranks, journaled and resumed, and stored in the profile
as a versioned section that older profiles are read without."""

from __future__ import annotations

import json
import random

import pytest

from agoq.cli import main
from agoq.commands import profile_layouts
from agoq.commands.profile_layouts import LAYOUTS, layout_kinds, layout_train_settings, measure_layout_steps
from agoq.formats.layout_steps import layout_rows
from agoq.formats.profile import load_profile
from agoq.train.config import TrainConfig
from tests.multiprocess import run_workers

ARGS = ["profile", "llama-tiny", "--device", "cpu", "--seq-len", "11", "--micro-batch", "2", "--bits", "4",
        "--formats", "int", "--batches", "1", "--quiet", "--measured-steps", "1", "--world-size", "2"]


def test_every_layout_is_a_train_configuration_of_its_parallel_mode():
    kinds = layout_kinds(3, "compiled")
    assert {(k["layout"], k["gradients"], k["weight_gather"]) for k in kinds} == set(LAYOUTS)
    for kind in kinds:
        cfg = TrainConfig(**layout_train_settings(kind, "llama-tiny", 17, "fp32", "cpu", 5, 0))
        assert cfg.parallelism.parallel == {"replicated": "ddp", "fsdp": "fsdp"}[kind["layout"]]
        assert cfg.parallelism.weight_gather == kind["weight_gather"] and cfg.memory.gradients == kind["gradients"]
        assert (cfg.data.micro_batch, cfg.data.grad_accum, cfg.loop.steps) == (3, 1, 5) and cfg.model.compile


class _MeasuredAgain(Exception):
    pass


def test_two_gloo_ranks_measure_every_layout_and_resume_from_the_journal(tmp_path, monkeypatch):
    journal = tmp_path / "layout.jsonl"
    kw = dict(model="llama-tiny", layers=1, seq_len=9, micro_batch=2, dtype="fp32", device="cpu",
              compile_mode="eager", warmup=1, steps=1, journal=journal)
    rows, failures = measure_layout_steps(2, **kw)
    assert not failures
    assert [(r["layout"], r["gradients"], r["weight_gather"]) for r in rows] == list(LAYOUTS)
    for row in rows:
        assert row["step_seconds"] > 0 and row["peak_bytes"] is None  # no allocator statistics on the CPU
        assert len(row["seconds_per_step"]) == 2 and row["step_seconds"] >= row["seconds_per_step"][1] * 0.999
    assert len(journal.read_text().splitlines()) == len(LAYOUTS)
    # resumed: nothing left to measure, nothing spawned, the same rows
    def spawned(*a, **k):
        raise _MeasuredAgain()

    monkeypatch.setattr(profile_layouts, "spawn_on_group", spawned)
    assert measure_layout_steps(2, **kw) == (rows, [])
    # another request (more steps) does not reuse the journal's lines
    with pytest.raises(_MeasuredAgain):
        measure_layout_steps(2, **{**kw, "steps": 2})


def _three_ranks(rank, world, kinds):
    from agoq.commands.profile_layouts import measure_on_group

    entries = measure_on_group(kinds, model="llama-tiny", seq_len=7, dtype="fp32", device="cpu", seed=0,
                               warmup=1, steps=1)
    return entries


def test_a_world_of_three_measures_the_sharded_layouts():
    kinds = [k for k in layout_kinds(1, "eager") if k["layout"] != "replicated"][-2:]
    results = run_workers(_three_ranks, 3, kinds)
    assert all("row" in e for e in results[0])
    # every rank agrees on the figures (the largest of any rank's median)
    assert [[e["row"]["step_seconds"] for e in r] for r in results] == [[e["row"]["step_seconds"]
                                                                         for e in results[0]]] * 3


def _fake_rows(world):
    rng = random.Random()
    return [{**k, "policy": "bf16", "warmup_steps": 1, "steps": 1, "step_seconds": rng.uniform(0.01, 1.0),
             "peak_bytes": rng.randrange(1 << 20, 1 << 30), "source": "profile"}
            for k in layout_kinds(2, "eager")]


def test_profile_stores_the_layout_steps_and_resume_keeps_them(tmp_path, monkeypatch, capsys):
    out = tmp_path / "p"
    calls = []
    rows = _fake_rows(2)

    def measured(world_size, **kw):
        calls.append((world_size, kw))
        return rows, [{"what": "layout step x", "error": "pretend"}]

    monkeypatch.setattr(profile_layouts, "measure_layout_steps", measured)
    monkeypatch.setattr("agoq.profiler.collectives.spawn_collectives", lambda *a, **k: ([], []))
    assert main([*ARGS, "--out", str(out)]) == 0
    assert len(calls) == 1 and calls[0][0] == 2
    said = capsys.readouterr().out
    assert "layout steps over 2 ranks" in said
    assert f"fsdp eager step, gradients sdp4bit, weight gather int8, micro-batch 2 x 1: {rows[4]['step_seconds'] * 1e3:.1f} ms" \
        in said
    assert calls[0][1]["micro_batch"] == 2 and calls[0][1]["seq_len"] == 11 and calls[0][1]["compile_mode"] == "eager"
    header = json.loads((out / "profile.json").read_text())
    assert header["schema"] == "agoq.profile/1.1" and header["layout_steps"]["world_size"] == 2
    assert load_profile(out).layout_steps() == layout_rows({"layout_steps": {"world_size": 2, "rows": rows}})
    assert any(f["what"] == "layout step x" for f in header["failures"])
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    assert len(calls) == 1  # complete: not measured again


def test_a_profile_without_layout_steps_reads_as_none_and_a_bad_section_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("agoq.profiler.collectives.spawn_collectives", lambda *a, **k: ([], []))
    out = tmp_path / "p"
    assert main([*ARGS[:-2], "--measured-steps", "0", "--out", str(out)]) == 0  # measured steps off: no layout steps
    header = json.loads((out / "profile.json").read_text())
    assert "layout_steps" not in header and load_profile(out).layout_steps() == []
    header["schema"] = "agoq.profile/1"  # an older profile
    (out / "profile.json").write_text(json.dumps(header))
    assert load_profile(out).layout_steps() == []
    bad = _fake_rows(2)
    bad[1]["weight_gather"] = "int8"  # a replicated step gathers no weights
    header["layout_steps"] = {"version": 1, "world_size": 2, "rows": bad}
    (out / "profile.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match=r"layout_steps.rows\[1\].weight_gather"):
        load_profile(out)
    # one rank measures one-rank FSDP2 only: a replicated row of one rank is refused, fsdp rows read
    one = _fake_rows(2)
    header["layout_steps"] = {"version": 1, "world_size": 1, "rows": one}
    (out / "profile.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match=r"layout_steps.rows\[0\].layout: a layout step of one rank is one-rank FSDP2"):
        load_profile(out)
    fsdp = [r for r in one if r["layout"] == "fsdp"]
    header["layout_steps"] = {"version": 1, "world_size": 1, "rows": fsdp}
    (out / "profile.json").write_text(json.dumps(header))
    assert load_profile(out).layout_steps() == layout_rows({"layout_steps": {"world_size": 1, "rows": fsdp}})
    header["layout_steps"] = {"version": 1, "world_size": 0, "rows": fsdp}
    (out / "profile.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match="layout_steps.world_size: must be an integer >= 1"):
        load_profile(out)
    # a profile measured before agoq's own sharded step was retired: that row is skipped, the others read
    rows = _fake_rows(2)
    retired = {**rows[0], "layout": "sharded", "gradients": "sdp4bit", "optimizer": "adamw8bit", "master": "fp32"}
    header["layout_steps"] = {"version": 1, "world_size": 2, "rows": [*rows, retired]}
    (out / "profile.json").write_text(json.dumps(header))
    kept = load_profile(out).layout_steps()
    assert kept == layout_rows({"layout_steps": {"world_size": 2, "rows": rows}}) and len(kept) == len(rows)


def test_processes_that_die_keep_what_they_journaled_for_resume(tmp_path, monkeypatch, capsys):
    out = tmp_path / "p"
    rows = _fake_rows(2)
    done = random.randrange(1, len(rows))

    def dying(world_size, kinds, settings, journal, request, use_cuda=None):
        for row in rows[:done]:  # journaled as measured, then the processes die
            profile_layouts._append(journal, {"request": request, "kind": {k: row[k] for k in kinds[0]}, "row": row})
        raise RuntimeError("layout steps: rank 0 left no result (exit codes [-9, -9])")

    monkeypatch.setattr(profile_layouts, "spawn_on_group", dying)
    monkeypatch.setattr("agoq.profiler.collectives.spawn_collectives", lambda *a, **k: ([], []))
    assert main([*ARGS, "--out", str(out)]) == 0
    assert "layout steps stopped" in capsys.readouterr().err
    header = json.loads((out / "profile.json").read_text())
    assert len(header["layout_steps"]["rows"]) == done
    assert (out / profile_layouts.JOURNAL_NAME).is_file()
    assert main([*ARGS, "--out", str(out)]) == 2  # a stopped profile is continued, not overwritten

    def rest(world_size, kinds, settings, journal, request, use_cuda=None):
        assert len(kinds) == len(rows) - done  # only what is missing
        return [{"kind": k, "row": next(r for r in rows if all(r[f] == k[f] for f in k))} for k in kinds]

    monkeypatch.setattr(profile_layouts, "spawn_on_group", rest)
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    header = json.loads((out / "profile.json").read_text())
    assert len(header["layout_steps"]["rows"]) == len(rows)
    assert not (out / profile_layouts.JOURNAL_NAME).exists()


def _under_torchrun(rank, world, journal):
    from agoq.commands.profile_layouts import measure_layout_steps_torchrun

    return measure_layout_steps_torchrun(model="llama-tiny", layers=1, seq_len=7, micro_batch=2, dtype="fp32",
                                         device="cpu", compile_mode="eager", warmup=1, steps=1,
                                         journal=__import__("pathlib").Path(journal) if rank == 0 else None)


def test_under_torchrun_rank_0_tells_the_others_what_its_journal_holds(tmp_path):
    from agoq.commands.profile_layouts import request_of

    journal = tmp_path / "layout.jsonl"
    kinds = layout_kinds(2, "eager")
    request = request_of("llama-tiny", 1, 7, 2, "fp32", "eager", 2, 0, 1, 1)
    held = random.sample(range(len(kinds)), len(kinds) - 2)
    fake = {i: {**kinds[i], "policy": "bf16", "warmup_steps": 1, "steps": 1, "step_seconds": random.uniform(1, 2),
                "peak_bytes": None, "source": "profile"} for i in held}
    for i in held:
        profile_layouts._append(journal, {"request": request, "kind": kinds[i], "row": fake[i]})
    results = run_workers(_under_torchrun, 2, str(journal))

    def agreed(rows):  # every figure but each rank's own step seconds (the row keeps rank 0's)
        return [{k: v for k, v in r.items() if k != "seconds_per_step"} for r in rows]

    assert agreed(results[0][0]) == agreed(results[1][0])
    rows, failures = results[0]
    assert not failures and [r["layout"] for r in rows] == [k["layout"] for k in kinds]
    for i, row in enumerate(rows):
        if i in held:  # kept from the journal, not measured again
            assert row == fake[i]
        else:  # measured now (a step of 7 tokens takes far less than a second)
            assert 0 < row["step_seconds"] < 1
    assert len(journal.read_text().splitlines()) == len(kinds)


def test_one_process_measures_fsdp2s_own_cost_and_resumes_from_the_journal(tmp_path, monkeypatch):
    journal = tmp_path / "layout.jsonl"
    kw = dict(model="llama-tiny", layers=1, seq_len=9, micro_batch=2, dtype="fp32", device="cpu",
              compile_mode="eager", warmup=1, steps=1, journal=journal)
    import torch.distributed as dist

    rows, failures = measure_layout_steps(1, **kw)  # in this process, a gloo group of one
    assert not dist.is_initialized()  # the group made for the steps is gone
    assert not failures
    fsdp = [k for k in LAYOUTS if k[0] == "fsdp"]  # DDP of one process is no DDP
    assert [(r["layout"], r["gradients"], r["weight_gather"]) for r in rows] == fsdp
    for row in rows:
        assert row["step_seconds"] > 0 and row["peak_bytes"] is None and len(row["seconds_per_step"]) == 2
    assert layout_rows({"layout_steps": {"world_size": 1, "rows": rows}}) == rows
    assert len(journal.read_text().splitlines()) == len(fsdp)

    def spawned(*a, **k):
        raise _MeasuredAgain()

    monkeypatch.setattr(profile_layouts, "spawn_on_group", spawned)
    monkeypatch.setattr(profile_layouts, "one_rank_here", spawned)
    assert measure_layout_steps(1, **kw) == (rows, [])  # resumed: nothing left to measure
    with pytest.raises(_MeasuredAgain):  # the two-rank request does not reuse the one-rank lines
        measure_layout_steps(2, **kw)


def test_train_refuses_fsdp_in_one_process_and_only_the_profile_lifts_it(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", "llama-tiny", "--parallel", "fsdp", "--steps", "2", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--parallel fsdp needs several processes: launch with torchrun" in err and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists()
    with pytest.raises(TypeError, match="unknown training setting"):  # not a flat setting, no flag
        TrainConfig(parallel="fsdp", one_rank_fsdp=True)
    cfg = TrainConfig(parallel="fsdp")
    with pytest.raises(ValueError, match="--parallel fsdp needs several processes"):
        cfg.parallelism.layout(1)
    assert cfg.one_rank_fsdp().parallelism.layout(1).mode == "fsdp"
    for mode in ("ddp", "pipeline"):  # one_rank lifts the refusal for fsdp only
        with pytest.raises(ValueError, match=f"--parallel {mode} needs several processes"):
            TrainConfig(parallel=mode).one_rank_fsdp().parallelism.layout(1)


def test_a_one_gpu_profile_measures_its_fsdp_layout_steps_and_resume_adds_them_to_an_older_one(tmp_path,
                                                                                                monkeypatch, capsys):
    out = tmp_path / "p"
    rows = [r for r in _fake_rows(1) if r["layout"] == "fsdp"]
    calls = []

    def measured(world_size, **kw):
        calls.append((world_size, kw))
        return rows, []

    monkeypatch.setattr(profile_layouts, "measure_layout_steps", measured)
    one_rank = ARGS[:-2]  # no --world-size
    assert main([*one_rank, "--out", str(out)]) == 0
    assert [c[0] for c in calls] == [1] and calls[0][1]["steps"] == 1
    assert "layout steps in one process (one-rank FSDP2: its own cost" in capsys.readouterr().out
    header = json.loads((out / "profile.json").read_text())
    assert header["layout_steps"]["world_size"] == 1 and load_profile(out).layout_steps() == layout_rows(
        {"layout_steps": {"world_size": 1, "rows": rows}})
    # a one-GPU profile made before one-rank FSDP2 was measured: --resume measures just the layout steps
    del header["layout_steps"]
    (out / "profile.json").write_text(json.dumps(header))
    import agoq.commands.profile_steps as profile_steps

    def steps_again(*a, **k):
        raise _MeasuredAgain()

    monkeypatch.setattr(profile_steps, "measure_profile_steps", steps_again)
    assert main([*one_rank, "--out", str(out), "--resume"]) == 0
    assert [c[0] for c in calls] == [1, 1]
    again = json.loads((out / "profile.json").read_text())
    assert again["layout_steps"]["world_size"] == 1 and again["measured_steps"] == header["measured_steps"]
    assert main([*one_rank, "--out", str(out), "--resume"]) == 0
    assert len(calls) == 2  # complete: not measured again
    # measured steps off: no layout steps either
    assert main([*one_rank, "--measured-steps", "0", "--out", str(tmp_path / "q")]) == 0
    assert len(calls) == 2 and "layout_steps" not in json.loads((tmp_path / "q" / "profile.json").read_text())
