"""float32 master weights: the optimizer steps float32 copies and the bf16 parameters get them rounded."""


import torch

from agoq.models import build
from agoq.runtime.optim.master_weights import MasterWeights


def _adamw_float64(w, g, lr, wd, beta1=0.9, beta2=0.999, eps=1e-8):
    """One AdamW step from zero moments, by hand in float64."""
    m = (1 - beta1) * g
    v = (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1), v / (1 - beta2)
    return w * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)


def test_masters_step_and_round_back_like_a_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(37, 13, generator=g).bfloat16().requires_grad_(True),
              torch.randn(29, generator=g).bfloat16().requires_grad_(True)]
    start = [p.detach().double() for p in params]
    grads = [torch.randn(p.shape, generator=g).bfloat16() for p in params]
    weights = MasterWeights(params)
    assert weights.masters is not None and all(m.dtype == torch.float32 for m in weights.masters)
    opt = torch.optim.AdamW(weights.targets, lr=3e-3, weight_decay=0.1)
    weights.set_grads(grads, scale=0.5)
    assert all(m.grad.dtype == torch.float32 for m in weights.masters)
    opt.step()
    weights.write_back()
    for p, m, w0, gr in zip(params, weights.masters, start, grads):
        ref = _adamw_float64(w0, gr.double() * 0.5, 3e-3, 0.1)
        torch.testing.assert_close(m.double(), ref, rtol=1e-6, atol=1e-7, msg=f"seed {seed}")
        assert torch.equal(p.detach(), m.detach().bfloat16())  # the parameter is its master, rounded
    weights.zero_grad()
    assert all(t.grad is None for t in params + weights.masters)


def test_float32_parameters_are_their_own_masters_and_bytes():
    model32 = build("llama-tiny")
    model16 = build("llama-tiny", dtype=torch.bfloat16)
    w = MasterWeights(model32.parameters())
    assert w.masters is None and w.targets[0] is next(model32.parameters())
    n = sum(p.numel() for p in model16.parameters() if p.requires_grad)
    assert MasterWeights.bytes_for(model16.parameters()) == 4 * n
    assert MasterWeights.bytes_for(model32.parameters()) == 0
