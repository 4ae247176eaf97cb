"""A what-if re-targeted from a profile of one GPU whose layout steps are one-rank FSDP2 (agoq.search.layout_calibration,
agoq.search.whatif): the step less the one-process compute is FSDP2's own cost, carried as an offset into every fsdp
price at N ranks (comm(X) = comm_model_N(X) + exposed; the peak moved by the measured margin), while the one-GPU
profile's own plans stay as they were, and fsdp is still refused on one rank."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from agoq.cli import main
from agoq.formats.profile import load_profile
from agoq.search.layout_calibration import anchor
from agoq.search.price import Configuration, price
from agoq.search.whatif import retarget
from tests.search.synthetic_profile import write_profile
from tests.search.test_whatif_cluster import _knobs, _measured_knobs as _measured  # a layout step's knobs

KINDS = (("fsdp", "bf16", "bf16"), ("fsdp", "sdp4bit", "bf16"), ("fsdp", "sdp4bit", "int8"),
         ("fsdp", "sdp4bit", "int4"))  # agoq.commands.profile_layouts measures these at one rank


def _one_gpu_profile(folder, rng):
    return write_profile(folder, rng, num_layers=3, micro_batch=3, seq_len=37, layer_forward=True,
                         compile_modes=("eager", "compiled"), step_peaks=True,
                         optimizer_step_bytes=rng.randrange(10**5, 10**6))


def _with_layout_steps(folder, rows):
    header = json.loads((folder / "profile.json").read_text())
    header["schema"] = "agoq.profile/1.1"
    header["layout_steps"] = {"version": 1, "world_size": 1, "rows": rows}
    (folder / "profile.json").write_text(json.dumps(header))


def _row(kind, compile_mode, step_seconds, peak_bytes):
    layout, gradients, gather = kind
    return {"layout": layout, "gradients": gradients, "weight_gather": gather, "compile": compile_mode,
            "policy": "bf16", "micro_batch": 3, "grad_accum": 1, "optimizer": "adamw8bit", "master": "fp32",
            "warmup_steps": 3, "steps": 6, "step_seconds": step_seconds, "peak_bytes": peak_bytes,
            "source": "profile"}


def test_a_one_rank_layout_step_moves_the_what_ifs_fsdp_price_by_fsdp2s_own_cost(tmp_path, seed):
    rng = random.Random(seed)
    folder = _one_gpu_profile(tmp_path / "p", rng)
    plain = load_profile(folder)
    compile_mode = rng.choice(["eager", "compiled"])
    # one-rank FSDP2 moves nothing: its compute is the one process's step of the same knobs (the whole state)
    truth, rows = {}, []
    for kind in KINDS:
        one = price(plain, Configuration(_measured("replicated", "bf16", "bf16", compile_mode)))
        assert one.communication_seconds == 0.0
        own = rng.uniform(0.02, 0.4) * one.step_seconds  # FSDP2's copies and hooks, the gathers' kernels
        rows.append(_row(kind, compile_mode, one.step_seconds + own, rng.randrange(10**6, 10**8)))
        truth[kind] = own
    copy = tmp_path / "with"
    shutil.copytree(folder, copy)
    _with_layout_steps(copy, rows)
    calibrated = load_profile(copy)
    n = rng.choice([2, 4, 8, 16])
    network = rng.choice(["nvlink-h100", "nvlink-a100", "intra=200@3,inter=25@10"])
    before, _ = retarget(plain, n, n, network)
    after, whatif = retarget(calibrated, n, n, network)
    assert whatif.layout_steps == len(KINDS) and whatif.measured_world == 1
    assert any("FSDP2's own cost per step measured in one process" in e for e in whatif.extrapolated())
    for kind, row in zip(KINDS, rows):
        margin = row["peak_bytes"] - anchor(calibrated, row)["peak_bytes"]
        configs = [Configuration(_measured(*kind, compile_mode)),
                   Configuration(_knobs(*kind, micro_batch=1, grad_accum=3, compile_mode=compile_mode)),
                   Configuration(_knobs(*kind, micro_batch=3, grad_accum=2, compile_mode=compile_mode),
                                 checkpoint_layers=(rng.randrange(3),))]
        for config in configs:
            x0, x1 = price(before, config), price(after, config)
            # comm(X) = comm_model_N(X) + exposed, exposed = R.step - compute(A)
            assert x1.communication_seconds == pytest.approx(x0.communication_seconds + truth[kind], rel=1e-9), \
                (seed, kind, config)
            assert x1.step_seconds == pytest.approx(x0.step_seconds + truth[kind], rel=1e-9), (seed, kind, config)
            assert abs(x1.peak_bytes - (x0.peak_bytes + margin)) <= 2, (seed, kind, config)
    # other layouts of the what-if (replicated: DDP has no one-rank step) are priced as before
    replicated = Configuration(_knobs("replicated", "bf16", "bf16", micro_batch=1, grad_accum=2))
    assert price(after, replicated) == price(before, replicated)
    # a layout step of the other compile mode calibrates the communication only
    other = "eager" if compile_mode == "compiled" else "compiled"
    config = Configuration(_measured("fsdp", "bf16", "bf16", other))
    x0, x1 = price(before, config), price(after, config)
    assert x1.communication_seconds == pytest.approx(x0.communication_seconds + truth[KINDS[0]], rel=1e-9)
    assert x1.peak_bytes == x0.peak_bytes


def _search(folder, out, *extra):
    return main(["search", "--profile", str(folder), "--budget", "1GiB", "--out", str(out), "--quiet",
                 "--front-budgets", "0", *extra])


def _plan_without_paths(out, folder):
    text = out.read_text().replace(str(folder), "PROFILE")
    data = json.loads(text)
    data.pop("date", None)
    data.get("source", {}).pop("date", None)
    return data


def test_the_one_gpu_profiles_own_plan_is_unchanged_and_fsdp_still_needs_several_ranks(tmp_path, seed, capsys):
    rng = random.Random(seed)
    folder = _one_gpu_profile(tmp_path / "p", rng)
    copy = tmp_path / "with"
    shutil.copytree(folder, copy)
    _with_layout_steps(copy, [_row(k, "eager", rng.uniform(0.01, 1.0), rng.randrange(10**6, 10**8)) for k in KINDS])
    assert _search(folder, tmp_path / "a.json") == 0
    assert _search(copy, tmp_path / "b.json") == 0
    assert _plan_without_paths(tmp_path / "a.json", folder) == _plan_without_paths(tmp_path / "b.json", copy)
    capsys.readouterr()
    assert _search(copy, tmp_path / "c.json", "--layout", "fsdp") == 2
    err = capsys.readouterr().err
    assert "fsdp" in err and "several ranks" in err and "Traceback" not in err
    assert not (tmp_path / "c.json").exists()
