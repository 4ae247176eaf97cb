"""One small profile of llama-tiny, made once for the profiler tests that read it."""

import pytest
import torch

from agoq.profiler.profile import ProfileSettings, make_profile

SETTINGS = dict(spec="llama-tiny", seq_len=23, micro_batch=3, dtype="fp32", device="cpu", bits=[2, 4, 8],
                formats=["int", "nf4"], batches=2, seed=5, pipeline_stages=2, micro_batches=4)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tiny models' small operations run fastest on one thread (and a shared machine stays responsive)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    header = make_profile(ProfileSettings(**SETTINGS), out, progress=False, say=lambda *a: None)
    return out, header
