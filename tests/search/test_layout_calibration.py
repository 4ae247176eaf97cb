"""The search calibrated on the profile's multi-rank layout steps (agoq.search.layout_calibration): from a profile
whose layout steps are drawn from a known truth, the one price reproduces each measured step and peak exactly at the
measured configuration and moves by the model's deltas elsewhere, for plans and alternatives alike."""

from __future__ import annotations

import json
import random

import pytest

from agoq.formats.profile import load_profile
from agoq.search.price import Configuration, price
from agoq.search.problem import ProblemSettings
from tests.search.synthetic_profile import write_profile

# (layout, gradients, weight gather) of the layout steps drawn; fsdp with TLq-HS and the bf16 gather left unmeasured
MEASURED = (("replicated", "bf16", "bf16"), ("replicated", "quangrad8", "bf16"), ("fsdp", "bf16", "bf16"),
            ("fsdp", "sdp4bit", "int8"), ("fsdp", "sdp4bit", "int4"))


def _profile(tmp_path, rng):
    folder = write_profile(tmp_path / "p", rng, num_layers=3, micro_batch=3, seq_len=37, world_size=2,
                           collectives=True, fsdp_collectives=True, link_bytes_per_second=rng.uniform(3e8, 3e9),
                           layer_forward=True, compile_modes=("eager", "compiled"), step_peaks=True,
                           optimizer_step_bytes=rng.randrange(10**5, 10**6))
    return folder


def _knobs(layout, gradients, gather, **kw):
    return ProblemSettings(layout=layout, gradient_mode=gradients, weight_gather=gather, layer_stage=(0, 0, 0),
                           allow_offload=False, **kw)


def _measured_knobs(layout, gradients, gather, compile_mode):
    """The configuration a layout step measures: the profile's micro-batch, one per step, every layer kept, the
    fused 8-bit AdamW over float32 masters."""
    return _knobs(layout, gradients, gather, micro_batch=3, grad_accum=1, optimizer="adamw8bit", master="fp32",
                  compile_mode=compile_mode)


def _others(layout, gradients, gather, compile_mode, rng):
    """Other configurations of one layout: other splits, per-layer choices, checkpointing, another optimizer."""
    base = dict(compile_mode=compile_mode)
    if rng.random() < 0.5:
        base.update(optimizer="adamw", master="fp32")
    return [Configuration(_knobs(layout, gradients, gather, micro_batch=1, grad_accum=3, **base)),
            Configuration(_knobs(layout, gradients, gather, micro_batch=3, grad_accum=2, **base),
                          checkpoint_layers=(rng.randrange(3),)),
            Configuration(_knobs(layout, gradients, gather, micro_batch=1, grad_accum=1, **base),
                          kinds=((rng.randrange(3), "ffn1_input", "4"),))]


def test_the_price_reproduces_each_layout_step_and_moves_by_the_models_deltas(tmp_path, seed):
    rng = random.Random(seed)
    folder = _profile(tmp_path, rng)
    plain = load_profile(folder)
    compile_mode = rng.choice(["eager", "compiled"])
    truth, rows = {}, []
    for layout, gradients, gather in MEASURED:
        at = price(plain, Configuration(_measured_knobs(layout, gradients, gather, compile_mode)))
        compute = at.step_seconds - at.communication_seconds
        exposed = rng.uniform(0.3, 4.0) * max(at.communication_seconds, 1e-3) + rng.uniform(0, 1e-3)
        margin = rng.randrange(-at.peak_bytes // 7, at.peak_bytes // 3)  # the model may miss either way
        truth[(layout, gradients, gather)] = (exposed, margin, at.communication_seconds)
        rows.append({"layout": layout, "gradients": gradients, "weight_gather": gather, "compile": compile_mode,
                     "policy": "bf16", "micro_batch": 3, "grad_accum": 1, "optimizer": "adamw8bit", "master": "fp32",
                     "warmup_steps": 3, "steps": 6, "step_seconds": compute + exposed,
                     "peak_bytes": at.peak_bytes + margin, "source": "profile"})
    header = json.loads((folder / "profile.json").read_text())
    header["schema"] = "agoq.profile/1.1"
    header["layout_steps"] = {"version": 1, "world_size": 2, "rows": rows}
    (folder / "profile.json").write_text(json.dumps(header))
    calibrated = load_profile(folder)

    for row in rows:  # exactly the measured step and peak at the measured configuration
        key = (row["layout"], row["gradients"], row["weight_gather"])
        got = price(calibrated, Configuration(_measured_knobs(*key, compile_mode)))
        assert got.step_seconds == pytest.approx(row["step_seconds"], rel=1e-9), (seed, key)
        assert got.communication_seconds == pytest.approx(truth[key][0], rel=1e-9), (seed, key)
        assert abs(got.peak_bytes - row["peak_bytes"]) <= 2, (seed, key)
    for key, (exposed, margin, modelled_at) in truth.items():  # elsewhere: the model's deltas on top
        for config in _others(*key, compile_mode, rng):
            before, after = price(plain, config), price(calibrated, config)
            comm = max(0.0, exposed + before.communication_seconds - modelled_at)
            assert after.communication_seconds == pytest.approx(comm, rel=1e-9, abs=1e-12), (seed, key, config)
            assert after.step_seconds == pytest.approx(before.step_seconds - before.communication_seconds + comm,
                                                       rel=1e-9), (seed, key, config)
            assert abs(after.peak_bytes - (before.peak_bytes + margin)) <= 2, (seed, key, config)
    # a layout without a layout step, and one process's pipeline of stages, are priced as before
    unmeasured = Configuration(_knobs("fsdp", "sdp4bit", "bf16", micro_batch=1, grad_accum=2))
    assert price(calibrated, unmeasured) == price(plain, unmeasured)


def test_a_layout_step_of_the_other_compile_mode_calibrates_the_communication_only(tmp_path, seed):
    rng = random.Random(seed)
    folder = _profile(tmp_path, rng)
    plain = load_profile(folder)
    measured = _measured_knobs("replicated", "bf16", "bf16", "compiled")
    at = price(plain, Configuration(measured))
    exposed = rng.uniform(1e-3, 5e-2)
    header = json.loads((folder / "profile.json").read_text())
    header["layout_steps"] = {"version": 1, "world_size": 2, "rows": [{
        "layout": "replicated", "gradients": "bf16", "weight_gather": "bf16", "compile": "compiled",
        "micro_batch": 3, "grad_accum": 1, "optimizer": "adamw8bit", "master": "fp32", "steps": 6,
        "step_seconds": at.step_seconds - at.communication_seconds + exposed,
        "peak_bytes": at.peak_bytes + rng.randrange(10**5, 10**6)}]}
    (folder / "profile.json").write_text(json.dumps(header))
    calibrated = load_profile(folder)
    eager = Configuration(_knobs("replicated", "bf16", "bf16", micro_batch=1, grad_accum=2, compile_mode="eager"))
    before, after = price(plain, eager), price(calibrated, eager)
    assert after.communication_seconds == pytest.approx(exposed, rel=1e-9)  # DDP's all-reduce: once per step
    assert after.peak_bytes == before.peak_bytes


def test_search_verbose_says_how_each_layout_was_calibrated(tmp_path, seed, capsys):
    from agoq.cli import main

    rng = random.Random(seed)
    folder = _profile(tmp_path, rng)
    plain = load_profile(folder)
    at = price(plain, Configuration(_measured_knobs("fsdp", "bf16", "bf16", "eager")))
    measured = at.step_seconds - at.communication_seconds + rng.uniform(1e-3, 1e-2)
    header = json.loads((folder / "profile.json").read_text())
    header["layout_steps"] = {"version": 1, "world_size": 2, "rows": [{
        "layout": "fsdp", "gradients": "bf16", "compile": "eager", "micro_batch": 3, "grad_accum": 1,
        "optimizer": "adamw8bit", "master": "fp32", "steps": 6, "step_seconds": measured, "peak_bytes": None}]}
    (folder / "profile.json").write_text(json.dumps(header))
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(folder), "--budget", "1TB", "--layout", "fsdp", "--gradients", "bf16",
                 "--compile", "eager", "--out", str(out), "--quiet", "--verbose"]) == 0
    said = capsys.readouterr().err
    assert "fsdp (bf16 gradients) communication calibrated on the profile's 2-rank layout step: it measured " \
           f"{measured * 1e3:.4g} ms" in said, said
    notes = json.loads(out.read_text())["source"]["notes"]
    assert any("calibrated on the profile's 2-rank layout step" in n for n in notes)


def test_a_layout_steps_anchor_is_the_same_for_threads_that_ask_while_it_is_made(tmp_path, seed, monkeypatch):
    """Threads share a profile (the plan service's requests, a search's side thread pricing its alternatives): a
    thread asking for a layout step's anchor while another is making it must get the anchor, never a placeholder
    (an anchor of None leaves a problem uncalibrated, silently: the search then prices that layout uncalibrated)."""
    import threading
    import time

    from agoq.search import layout_calibration

    rng = random.Random(seed)
    folder = _profile(tmp_path, rng)
    header = json.loads((folder / "profile.json").read_text())
    row = {"layout": "fsdp", "gradients": "bf16", "compile": "eager", "micro_batch": 3, "grad_accum": 1,
           "optimizer": "adamw8bit", "master": "fp32", "steps": 6, "step_seconds": rng.uniform(0.01, 0.1),
           "peak_bytes": None}
    header["layout_steps"] = {"version": 1, "world_size": 2, "rows": [row]}
    (folder / "profile.json").write_text(json.dumps(header))
    row = load_profile(folder).layout_steps()[0]  # as the profile reads it
    expected = layout_calibration._anchor(load_profile(folder), row)  # on a profile of its own
    assert expected is not None
    profile = load_profile(folder)
    real, started = layout_calibration._anchor, threading.Event()

    def slow(*args):
        started.set()
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(layout_calibration, "_anchor", slow)
    first = []
    maker = threading.Thread(target=lambda: first.append(layout_calibration.anchor(profile, row)))
    maker.start()
    assert started.wait(10)
    meanwhile = layout_calibration.anchor(profile, row)
    maker.join()
    assert meanwhile == expected and first == [expected], (seed, meanwhile, first, expected)
