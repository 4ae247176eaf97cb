"""Sensitivities spread over a local Ray as one task per layer give the same figures as one process."""

import pytest

from agoq.profiler.model_source import load_model, token_batches
from agoq.profiler.sensitivity import Measurement, SensitivityMeter, measure_chunk


def test_ray_tasks_match_local():
    ray = pytest.importorskip("ray")
    from agoq.profiler.ray_tasks import ray_measure

    job = {"spec": "llama-tiny", "dtype": "fp32", "device": "cpu", "seed": 4, "batches": 1, "micro_batch": 2,
           "seq_len": 11, "block": 128, "layers": 2}
    chunks = [[{"layer": layer, "kind": kind, "option": option, "format": "int"}
               for kind, option in (("norm_input", "3"), ("silu_input", "5"))] for layer in range(2)]
    try:
        got = ray_measure(job, chunks, None)  # starts a local Ray
    except ValueError as e:
        if "cannot start" not in str(e):
            raise
        pytest.skip(f"a local Ray cannot start here: {e}")
    finally:
        ray.shutdown()
    model = load_model("llama-tiny", dtype="fp32", seed=4, num_layers=2)
    meter = SensitivityMeter(model, token_batches(256, 1, 2, 11, 4, "cpu"))
    local = measure_chunk(meter, [Measurement(**m) for chunk in chunks for m in chunk])
    key = lambda r: (r["layer"], r["kind"])  # noqa: E731
    assert sorted(got, key=key) == sorted(local, key=key)
    assert all(r["sensitivity"] > 0 for r in got)
