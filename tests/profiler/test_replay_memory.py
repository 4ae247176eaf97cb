"""A replay session frees its kept forward when closed (no graph left in a reference cycle)."""

import gc

import torch

from agoq.models import build
from agoq.profiler.replay import ReplaySession
from agoq.profiler.sensitivity import measurement_policy, reference_kind


def _graph_tensors_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_closed_session_keeps_no_graph():
    model = build("llama-tiny", dtype=torch.float32, seed=5)
    ids = torch.randint(0, model.config.vocab_size, (2, 29))
    before = _graph_tensors_alive()
    session = ReplaySession(model, ids, measurement_policy(None, reference_kind("silu_input"), 64))
    session.error(1, "silu_input", 4, "int")
    session.close()
    del session
    assert _graph_tensors_alive() == before
