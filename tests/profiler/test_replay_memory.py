"""A replay session frees its kept forward when closed (no graph left in a reference cycle).

The check (tests/leaks.py): every tensor object that came into existence while the session was open (its
outputs, the gradients, and the detached copies its saved-tensor hook hands autograd, which only the
graph holds) is gone once the session is closed and dropped. The second test shows that the check sees
a graph kept alive, even through one of its nodes alone.
"""

import pytest
import torch

from agoq.models import build
from agoq.profiler.replay import ReplaySession
from agoq.profiler.sensitivity import measurement_policy, reference_kind
from tests.leaks import NewTensors


def _session_leftovers(seed: int, keep=None) -> tuple[int, int]:
    """(tensors made while a session was open, how many of them outlive it); `keep(session)` may hold on to
    something of the session until they are counted."""
    model = build("llama-tiny", dtype=torch.float32, seed=seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 29))
    with NewTensors() as made:
        session = ReplaySession(model, ids, measurement_policy(None, reference_kind("silu_input"), 64))
        session.error(1, "silu_input", 4, "int")
    kept = keep(session) if keep is not None else None
    session.close()
    del session
    alive = made.alive()
    del kept
    return made.count, alive


def test_closed_session_keeps_no_graph(seed):
    made, alive = _session_leftovers(seed)
    assert made > 0
    assert alive == 0, f"{alive} of the {made} tensors a replay session made outlive it"


@pytest.mark.parametrize("keep", ["output node", "outputs"])
def test_check_sees_a_kept_graph(seed, keep):
    """The check above fails when something keeps the graph: the last layer's output's grad_fn alone (no
    tensor with a grad_fn stays alive then, only the graph's nodes and the saved tensors they hold), or the
    output tensors themselves."""
    hold = {"output node": lambda s: s.outputs[-1].grad_fn, "outputs": lambda s: list(s.outputs)}[keep]
    made, alive = _session_leftovers(seed, hold)
    assert made > 0 and alive > 0
