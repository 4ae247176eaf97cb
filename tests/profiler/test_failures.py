"""A measurement that fails (an OOM, an exception) is recorded and the profile goes on."""

import json

import pandas as pd
import torch

from agoq.profiler import memory, replay, sensitivity
from agoq.profiler.profile import ProfileSettings, make_profile


def test_oom_is_recorded_and_the_profile_completes(tmp_path, monkeypatch):
    real_measure = sensitivity.SensitivityMeter.measure
    real_replay = replay.ReplaySession.error
    real_step = memory.measure_step

    def measure(self, m):
        if m.layer == 1 and m.kind == "silu_input" and m.option == "4":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if m.layer == 0 and m.kind == "attention" and m.option == "2":
            raise RuntimeError("something else broke")
        return real_measure(self, m)

    def replayed(self, layer, kind, bits, fmt):
        if layer == 1 and kind == "silu_input" and bits == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if layer == 0 and kind == "attention" and bits == 2:  # not out of memory: falls back to its policy run
            raise RuntimeError("replay broke")
        return real_replay(self, layer, kind, bits, fmt)

    def step(model, ids, policy):
        if policy == "agoq-paper":
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return real_step(model, ids, policy)

    monkeypatch.setattr(sensitivity.SensitivityMeter, "measure", measure)
    monkeypatch.setattr(replay.ReplaySession, "error", replayed)
    monkeypatch.setattr(memory, "measure_step", step)
    settings = ProfileSettings("llama-tiny", seq_len=9, micro_batch=1, dtype="fp32", bits=[2, 4], formats=["int"],
                               batches=1, layers=2)
    header = make_profile(settings, tmp_path, progress=False, say=lambda *a: None)
    failures = json.loads((tmp_path / "profile.json").read_text())["failures"]
    whats = [f["what"] for f in failures]
    assert "sensitivity layer=1 kind=silu_input option=4 format=int" in whats
    assert "sensitivity layer=0 kind=attention option=2 format=int" in whats
    assert "memory step policy=agoq-paper" in whats
    oom = next(f for f in failures if "silu_input" in f["what"])
    assert oom["error"].startswith("out of memory")
    table = pd.read_parquet(tmp_path / "profile.parquet")
    assert len(table) == 2 * (7 * 3 + 3) - 2  # every other measurement is there
    assert not ((table.layer == 1) & (table.kind == "silu_input") & (table.option == "4")).any()
    assert [s["policy"] for s in header["memory"]["steps"]] == ["bf16", "agoq-paper"]
