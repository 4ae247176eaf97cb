"""measure_steps runs `agoq train`'s own steps in this process and writes nothing: as many steps as asked, a loss,
seconds and (on a GPU) a peak for each, the first included; and the losses `agoq train` writes for the same
seed, steps and settings, exactly (with a policy, with a plan, and for the search's measure_plan)."""

import json
import math
import os
import random
import statistics

import pytest
import torch

from agoq.cli import main
from agoq.formats.plan import plan_from_dict
from agoq.models import build, fingerprint
from agoq.train.config import TrainConfig
from agoq.train.measure import StepFigures, measure_plan, measure_steps, one_process_plan

LAYERS = 3  # llama-tiny


def _rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    return random.Random(seed)


def _train_losses(out, *flags) -> list[float]:
    """The losses `agoq train llama-tiny` writes to metrics.jsonl (no checkpoint; one evaluation, at the end)."""
    assert main(["train", "llama-tiny", "--device", "cpu", "--checkpoint-every", "0", "--eval-batches", "1",
                 "--quiet", "--out", str(out), *flags]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _plan_data(rng, **sections) -> dict:
    """A llama-tiny plan: one layer checkpointed, the others at random widths or recomputed; quangrad8 gradients,
    8-bit AdamW with float32 masters, eager; a batch of odd shape."""
    model = build("llama-tiny")
    whole = rng.randrange(LAYERS)
    layers = [{"layer": i, "checkpoint": i == whole,
               "kinds": {} if i == whole else {"norm_input": rng.randint(2, 8), "qkv_input": "recompute",
                                               "silu_input": rng.randint(2, 8), "o_proj_input": rng.randint(3, 8)}}
              for i in range(LAYERS)]
    data = {"schema": "agoq.plan/1.1", "model": {"name": model.config.name, "fingerprint": fingerprint(model)},
            "layers": layers, "gradients": {"mode": "quangrad8"}, "optimizer": {"name": "adamw8bit", "master": "fp32"},
            "training": {"micro_batch": rng.randint(1, 3), "seq_len": rng.randint(11, 29),
                         "grad_accum": rng.randint(1, 2), "compile": "eager"}}
    data.update(sections)
    stages = data.get("pipeline", {}).get("stages", 1)
    for i, lp in enumerate(layers):
        lp["stage"] = min(stages - 1, i * stages // LAYERS)
    plan_from_dict(data)  # valid
    return data


def test_the_steps_and_their_figures(tmp_path):
    rng = _rng()
    steps = rng.randint(2, 4)
    out = tmp_path / "never"
    cfg = TrainConfig(model="llama-tiny", policy="agoq-paper", steps=steps, seed=rng.randrange(1000), device="cpu",
                      seq_len=rng.randint(9, 33), micro_batch=rng.randint(1, 3), grad_accum=rng.randint(1, 3),
                      out=str(out), quiet=True)
    figures = measure_steps(cfg)
    assert len(figures.losses) == len(figures.seconds) == steps
    assert all(math.isfinite(loss) and loss > 0 for loss in figures.losses)
    assert all(s > 0 for s in figures.seconds)
    assert figures.peak_bytes is None and figures.max_peak_bytes is None and figures.device == "cpu"  # a CPU
    assert figures.median_seconds == statistics.median(figures.seconds[1:])
    assert not out.exists()  # no run folder


def test_first_and_largest_peak_and_the_median_after_warm_up():
    rng = _rng()
    n = rng.randint(2, 9)
    peaks = [rng.randrange(1, 10**10) for _ in range(n)]
    seconds = [rng.random() for _ in range(n)]
    figures = StepFigures([rng.random() for _ in range(n)], seconds, peaks, "cuda:0")
    assert figures.first_peak_bytes == peaks[0] and figures.max_peak_bytes == max(peaks)
    assert figures.median_seconds == statistics.median(seconds[1:])
    d = figures.to_dict()
    assert (d["peak_bytes"], d["first_step_peak_bytes"], d["step_seconds"]) == (max(peaks), peaks[0],
                                                                                statistics.median(seconds[1:]))
    assert d["peak_bytes_per_step"] == peaks and d["seconds_per_step"] == seconds
    assert StepFigures([1.0], [0.25], [7], "cuda:0").median_seconds == 0.25  # one step: its own


@pytest.mark.parametrize("run", ["policy", "plan"])
def test_the_losses_are_agoq_trains(tmp_path, run):
    rng = _rng()
    steps, seed = 3, rng.randrange(10**6)
    if run == "plan":
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps(_plan_data(rng)))
        flags = ["--plan", str(plan)]
    else:
        flags = ["--policy", rng.choice(["agoq-paper", "int4", "int2"]), "--gradients", "quangrad8",
                 "--seq-len", str(rng.randint(9, 33)), "--micro-batch", str(rng.randint(1, 3)),
                 "--grad-accum", str(rng.randint(1, 3))]
    flags += ["--steps", str(steps), "--seed", str(seed), "--lr", "3e-3", "--eval-every", str(steps)]
    trained = _train_losses(tmp_path / "run", *flags)
    settings = json.loads((tmp_path / "run" / "run.json").read_text())["settings"]
    cfg = TrainConfig(model="llama-tiny", steps=steps, seed=seed, lr=3e-3, device="cpu", quiet=True,
                      **({"plan": str(plan)} if run == "plan" else
                         {"policy": settings["policy"], "gradients": "quangrad8", "seq_len": settings["seq_len"],
                          "micro_batch": settings["micro_batch"], "grad_accum": settings["grad_accum"]}))
    measured = measure_steps(cfg).losses
    assert len(trained) == steps and measured == trained  # the same code: the same floats
    plain = measure_steps(TrainConfig(model="llama-tiny", steps=steps, seed=seed, lr=3e-3, device="cpu", quiet=True,
                                      seq_len=settings["seq_len"], micro_batch=settings["micro_batch"],
                                      grad_accum=settings["grad_accum"])).losses
    # the first forward is the plain model's; the bits kept for backward move the next ones
    assert plain[0] == measured[0] and plain[-1] != measured[-1]


def test_measure_plan_trains_the_plan_as_agoq_train_does(tmp_path):
    """The search's measurement of a plan (its JSON data and the model config) is `agoq train --plan` of it."""
    rng = _rng()
    data = _plan_data(rng)
    t = data["training"]
    seed, steps = rng.randrange(10**6), 3
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    trained = _train_losses(tmp_path / "run", "--plan", str(plan), "--steps", str(steps), "--seed", str(seed),
                            "--lr", "1e-4", "--dtype", "fp32", "--eval-every", str(steps))
    r = measure_plan(data, build("llama-tiny").config.to_dict(), dtype="fp32", micro_batch=t["micro_batch"],
                     seq_len=t["seq_len"], grad_accum=t["grad_accum"], steps=steps, seed=seed, device="cpu")
    assert r["losses"] == trained and r["peak_bytes"] is None and r["device"] == "cpu"
    assert len(r["seconds_per_step"]) == steps and r["step_seconds"] == statistics.median(r["seconds_per_step"][1:])


def test_a_plan_as_one_process_runs_it():
    """A pipeline plan of sharded gradients, launched over several processes, measured in one: every layer on
    stage 0, no launch, no budget or per-stage predictions, the gradient storage and shape given."""
    rng = _rng()
    stages = rng.randint(2, LAYERS)
    data = _plan_data(rng, pipeline={"stages": stages, "micro_batches": 4}, budget_bytes=10**9,
                      launch={"processes": stages, "parallel": "pipeline", "command": "torchrun ..."},
                      predicted={"peak_bytes_per_stage": [10**8] * stages})
    mine = one_process_plan(data, micro_batch=5, seq_len=17, grad_accum=3, gradients="bf16")
    assert [lp.stage for lp in mine.layers] == [0] * LAYERS and mine.pipeline.stages == 1
    assert "launch" not in mine.to_dict() and mine.budget_bytes is None and mine.predicted.peak_bytes_per_stage == []
    assert (mine.gradients.mode, mine.optimizer.name, mine.optimizer.master, mine.training.compile) == (
        "bf16", "adamw8bit", "fp32", "eager")
    assert (mine.training.micro_batch, mine.training.seq_len, mine.training.grad_accum) == (5, 17, 3)
    assert mine.states_run_settings() == {"optimizer": True, "compile": True}
    assert [lp.kinds for lp in mine.layers] == [lp.kinds for lp in plan_from_dict(data).layers]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak bytes are measured on a GPU")
def test_peaks_on_a_gpu():
    """Each step's peak holds at least what lives through it: from the second step on, the bf16 weights, their
    float32 masters and AdamW's two float32 moments (2 + 4 + 8 bytes a parameter)."""
    figures = measure_steps(TrainConfig(model="llama-tiny", steps=4, device="cuda", dtype="bf16", seq_len=64,
                                        micro_batch=4, quiet=True))
    parameters = sum(p.numel() for p in build("llama-tiny").parameters())
    assert len(figures.peak_bytes) == 4 and figures.device.startswith("cuda")
    assert all(p >= 14 * parameters for p in figures.peak_bytes[1:]), figures.peak_bytes
    assert figures.first_peak_bytes >= 2 * parameters
    assert figures.max_peak_bytes == max(figures.peak_bytes)


def test_a_measurement_leaves_nothing_behind():
    """Measuring one run after another keeps no tensor of the earlier ones alive: QuanGrad's capture hooks are a
    reference cycle through autograd until removed, and a GPU measurement would count the leftovers in its peak."""
    import gc

    def alive() -> int:
        return sum(o.numel() for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() > 1000)

    start = alive()
    for gradients in ("quangrad8", "bf16"):
        measure_steps(TrainConfig(model="llama-tiny", device="cpu", steps=2, seq_len=32, micro_batch=2, quiet=True,
                                  checkpoint_every=0, optimizer="adamw8bit", gradients=gradients))
        gc.collect()
        assert alive() == start, gradients
