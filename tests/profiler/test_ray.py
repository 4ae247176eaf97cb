"""Sensitivities spread over a local Ray (one task per layer) give the same profile as one process."""

import pandas as pd
import pytest

from agoq.profiler.profile import ProfileSettings, make_profile


def test_ray_profile_matches_local(tmp_path):
    ray = pytest.importorskip("ray")
    settings = dict(spec="llama-tiny", seq_len=11, micro_batch=2, dtype="fp32", bits=[3, 5], formats=["int"],
                    batches=1, layers=2, seed=4)
    make_profile(ProfileSettings(**settings), tmp_path / "local", progress=False, say=lambda *a: None)
    try:
        make_profile(ProfileSettings(**settings, ray_address="local"), tmp_path / "ray", progress=False,
                     say=lambda *a: None)  # starts a local Ray
    except ValueError as e:
        if "cannot start" not in str(e):
            raise
        pytest.skip(f"a local Ray cannot start here: {e}")
    finally:
        ray.shutdown()
    local = pd.read_parquet(tmp_path / "local" / "profile.parquet")
    spread = pd.read_parquet(tmp_path / "ray" / "profile.parquet")
    cols = ["layer", "kind", "option", "format", "bytes", "bytes_measured", "sensitivity", "quant_error"]
    assert spread[cols].equals(local[cols])
    assert (local.sensitivity[local.option.isin(["3", "5"])] > 0).all()
