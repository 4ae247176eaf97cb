"""The saved-tensor tracker on hand-made graphs whose saved tensors are known in closed form."""

import random

import pytest
import torch
from torch import nn

import agoq
from tests.leaks import NewTensors


def fresh_gen():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, torch.Generator().manual_seed(seed)


class ReluGate(nn.Module):
    """y = relu(x @ W) * z.

    With x and z requiring grad, autograd keeps: x (for W's gradient), W (a parameter: not counted),
    r = relu(x @ W) (relu's backward, and mul's for z's gradient) and z (mul's backward for r).
    The extra term (x_flat * x_flat) saves two views of x's storage, which must not count again.
    """

    def __init__(self, c_in, c_out, gen):
        super().__init__()
        self.W = nn.Parameter(torch.randn(c_in, c_out, generator=gen))
        self.register_buffer("offset", torch.randn(c_out, generator=gen))

    def forward(self, x, z, with_views=False):
        r = (x @ self.W).relu()
        y = r * z
        if with_views:
            xf = x.reshape(-1)
            y = y + (xf[: y.numel()] * xf[1: y.numel() + 1]).view_as(y)
        # y * buffer saves only the buffer (y's gradient needs it, the buffer needs none): not counted
        return y * self.offset


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.float64, 8), (torch.bfloat16, 2)])
@pytest.mark.parametrize("with_views", [False, True])
def test_closed_form_total(dtype, elem, with_views):
    seed, g = fresh_gen()
    B, S, Ci, Co = 3, 7, 13, 11  # x has more values than y, so the view term fits inside x
    m = ReluGate(Ci, Co, g).to(dtype)
    x = torch.randn(B, S, Ci, generator=g).to(dtype).requires_grad_()
    z = torch.randn(B, S, Co, generator=g).to(dtype).requires_grad_()
    with agoq.track_saved_tensors(m) as log:
        y = m(x, z, with_views)
    # x, relu(x @ W) and z
    expect = elem * (B * S * Ci + B * S * Co + B * S * Co)
    assert log.total() == expect, f"seed {seed}: {log.total()} != {expect}; {log.tensors}"
    assert not log.by_layer, "a model without decoder layers attributes nothing to layers"
    # the tracker is off after the block: a second pass adds nothing
    m(x, z, with_views).sum().backward()
    assert log.total() == expect
    y.sum().backward()


def test_parameters_and_buffers_not_counted():
    seed, g = fresh_gen()
    lin = nn.Linear(17, 5, bias=True)
    x = torch.randn(4, 17, generator=g)  # no grad: only the weight's gradient needs x
    with agoq.track_saved_tensors(lin) as log:
        out = lin(x)
    assert log.total() == 4 * x.numel(), f"seed {seed}: {log.tensors}"
    out.sum().backward()
    # the same parameter handed in as an input is still a parameter: nothing is counted
    w = lin.weight
    with agoq.track_saved_tensors(lin) as log:
        (w * w).sum()
    assert log.total() == 0, log.tensors


def test_views_of_one_storage_count_once():
    seed, g = fresh_gen()
    base = torch.randn(5, 23, generator=g, requires_grad=True)
    holder = nn.Module()
    with agoq.track_saved_tensors(holder) as log:
        a = base * 1.5  # saves nothing (scalar factor)
        p = a[:, :11] * a[:, 12:]  # two views of a's storage, saved by the product
        q = a.t() * a.t()  # another two views of the same storage
        loss = p.sum() + q.sum()
    assert log.total() == 4 * a.numel(), f"seed {seed}: {log.tensors}"
    loss.backward()
    expect = torch.zeros(5, 23, dtype=torch.float64)
    a64 = base.detach().double() * 1.5
    expect[:, :11] += a64[:, 12:] * 1.5
    expect[:, 12:] += a64[:, :11] * 1.5
    expect += 2 * a64 * 1.5
    torch.testing.assert_close(base.grad.double(), expect, rtol=1e-5, atol=1e-5)


class FakeLayer(nn.Module):
    """Has the four attributes the tracker looks for; saves its input and relu(attn(input))."""

    def __init__(self, c):
        super().__init__()
        self.self_attn = nn.Linear(c, c, bias=False)
        self.mlp = nn.Linear(c, c, bias=False)
        self.input_layernorm = nn.Identity()
        self.post_attention_layernorm = nn.Identity()

    def forward(self, x, scale):
        h = self.self_attn(x).relu()
        return self.mlp(h) * scale


class FakeModel(nn.Module):
    def __init__(self, c, n):
        super().__init__()
        self.layers = nn.ModuleList(FakeLayer(c) for _ in range(n))

    def forward(self, x, scale):
        for layer in self.layers:
            x = layer(x, scale)
        return x


def test_per_layer_attribution_closed_form():
    """Layer i keeps its input (self_attn's linear) and relu's output; the extra layer argument
    `scale` is shared by all layers and counted once, outside them."""
    seed, g = fresh_gen()
    B, S, C, n = 3, 29, 19, 4
    model = FakeModel(C, n)
    x = torch.randn(B, S, C, generator=g)
    scale = torch.rand(C, generator=g) + 0.5
    with agoq.track_saved_tensors(model) as log:
        out = model(x, scale)
    for i in range(n):
        assert log.layer_total(i) == 2 * 4 * B * S * C, f"seed {seed} layer {i}: {log.by_layer[i]}"
    assert sum(log.outside.values()) == 4 * C, f"seed {seed}: {dict(log.outside)}"
    assert log.total() == n * 2 * 4 * B * S * C + 4 * C
    out.sum().backward()


def _tracked_leftovers(seed: int, keep=None) -> tuple[int, int]:
    """(tensors made by a tracked forward, how many outlive it once the loss is dropped); `keep(loss)` may hold
    on to something of the graph until they are counted."""
    from agoq.models import build

    model = build("llama-tiny", dtype=torch.float32, seed=seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    with NewTensors() as made:
        with agoq.track_saved_tensors(model):
            loss = model(ids[:, :-1], ids[:, 1:])
    kept = keep(loss) if keep is not None else None
    del loss
    alive = made.alive()
    del kept
    return made.count, alive


def test_tracking_leaves_no_graph_alive(seed):
    """The tracker's pack hook must not hand autograd the saved tensor itself: a saved output (the
    loss's log_softmax) would then hold its own graph in a cycle no collector frees (tests/leaks.py)."""
    made, alive = _tracked_leftovers(seed)
    assert made > 0
    assert alive == 0, f"{alive} of the {made} tensors a tracked forward made outlive its loss"


def test_leak_check_sees_a_kept_graph(seed):
    made, alive = _tracked_leftovers(seed, keep=lambda loss: loss.grad_fn)
    assert made > 0 and alive > 0
