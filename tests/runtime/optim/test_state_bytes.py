"""agoq.runtime.optim.state_bytes against what the optimizers and QuanGrad really allocate (CPU), and the closed form of
LLaMA-3-8B's parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agoq.runtime.comm.quangrad import QuantizedGradients
from agoq.models import build
from agoq.models.llama import PRESETS, LlamaConfig
from agoq.runtime.optim.adamw8bit import FusedAdamW8bit
from agoq.runtime.optim.master_weights import MasterWeights
from agoq.runtime.optim.state_bytes import state_bytes, state_table


def _odd_model():
    # non-round sizes: hidden 72 (norms of 72 < 4096 keep float32 moments), vocab 300, FFN 200, head_dim 18
    cfg = LlamaConfig(vocab_size=300, hidden_size=72, intermediate_size=200, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, name="odd")
    return build(cfg, dtype=torch.bfloat16, seed=3)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _step(model) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    model(ids[:, :-1], ids[:, 1:]).backward()


@pytest.mark.parametrize("master", ["fp32", "none"])
def test_fused_adamw8bit_state_is_what_it_allocates(master):
    model = _odd_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = FusedAdamW8bit(params, lr=1e-3, masters=master == "fp32")
    _step(model)
    opt.step()
    held = [t for st in opt.state.values() for k, t in st.items() if isinstance(t, torch.Tensor) and k != "master"]
    masters = [st["master"] for st in opt.state.values() if "master" in st]
    counted = state_bytes([p.numel() for p in params], optimizer="adamw8bit", master=master, gradients="bf16")
    assert _nbytes(held) == counted["moments"]
    assert _nbytes(masters) == counted["masters"]
    assert _nbytes(p.grad for p in params) == counted["gradients"]
    assert _nbytes(model.parameters()) == counted["weights"]
    assert counted["step_transient"] == 0
    # the float32-moment rule for small parameters is in play (norm weights of 72 values)
    assert any("exp_avg" in st for st in opt.state.values()) and any("exp_avg_codes" in st for st in opt.state.values())


def test_torch_adamw_with_masters_state_and_transient():
    model = _odd_model()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = MasterWeights(params)
    opt = torch.optim.AdamW(weights.targets, lr=1e-3)
    _step(model)
    weights.step(opt)
    moments = [t for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    counted = state_bytes([p.numel() for p in params], optimizer="adamw", master="fp32", gradients="bf16")
    assert _nbytes(moments) == counted["moments"]
    assert _nbytes(weights.masters) == counted["masters"]
    # during the step the masters hold float32 copies of the gradients: the transient
    assert _nbytes(m.grad for m in weights.masters) == counted["step_transient"]


def test_quangrad_buffer_is_what_it_allocates():
    model = _odd_model()
    params = [p for p in model.parameters() if p.requires_grad]
    q = QuantizedGradients(params)
    counted = state_bytes([p.numel() for p in params], optimizer="adamw8bit", master="fp32", gradients="quangrad8")
    assert q.nbytes == _nbytes([q.codes, q.scales]) == counted["gradients"]
    q.remove()


def test_masters_none_needs_the_8bit_step():
    with pytest.raises(ValueError, match="adamw8bit"):
        state_bytes([10], optimizer="adamw", master="none", gradients="bf16")
    with pytest.raises(ValueError, match="gradient storage"):
        state_bytes([10], optimizer="adamw", master="fp32", gradients="int4")


def test_llama_3_8b_closed_form():
    """Every part for LLaMA-3-8B's shapes (vocab 256, as experiments/train_8b_memory.py trains it), against
    sums written out per weight matrix: 32 layers of q, o (4096^2), k, v (4096 x 1024), gate, up, down
    (4096 x 14336), two norms (4096); embedding and head (256 x 4096); the final norm."""
    cfg = dataclasses.replace(PRESETS["llama-3-8b"], vocab_size=256)
    model = build(cfg, device="meta", dtype=torch.bfloat16)
    numels = [p.numel() for p in model.parameters()]
    H, KV, F, V, L = 4096, 1024, 14336, 256, 32
    mats = [H * H] * 2 + [H * KV] * 2 + [H * F] * 3
    assert sorted(numels) == sorted(mats * L + [H] * (2 * L + 1) + [V * H] * 2)
    n = sum(numels)
    blocks = lambda m: -(-m // 256)  # noqa: E731
    # every tensor of 4096 values or more: 8-bit moments, codes padded to blocks of 256 plus a float32 scale
    moments = 2 * sum(blocks(m) * 260 for m in mats) * L + 2 * (2 * L + 1) * blocks(H) * 260 + 2 * 2 * blocks(V * H) * 260
    counted = state_bytes(numels, optimizer="adamw8bit", master="fp32", gradients="quangrad8")
    assert counted["weights"] == 2 * n and counted["masters"] == 4 * n
    assert counted["moments"] == moments
    assert counted["gradients"] == moments // 2  # the same padded layout, one buffer
    table = state_table(numels)
    assert table["optimizers"]["adamw8bit/none"]["masters"] == 0
    assert table["optimizers"]["adamw/fp32"]["moments"] == 8 * n
    # 6.98 B parameters: bf16 weights 13.96 GB, masters 27.93 GB, 8-bit moments and gradients 14.2 + 7.1 GB
    assert abs(counted["total"] / 1e9 - 63.16) < 0.01
