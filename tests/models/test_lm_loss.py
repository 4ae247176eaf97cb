"""Chunked LM head + cross-entropy against the plain full-logits loss, values and gradients, in float64."""


import pytest
import torch
import torch.nn.functional as F

from agoq.models import build
from agoq.models.lm_loss import chunked_lm_loss


def _plain(hidden, weight, labels):
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 7, 53, 10_000])
def test_loss_and_gradients_equal_full_logits_float64(chunk, seed):
    g = torch.Generator().manual_seed(seed)
    B, S, C, V = 3, 19, 24, 131
    hidden = torch.randn(B, S, C, generator=g, dtype=torch.float64)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.2] = -100  # some ignored positions
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    scale = 1.7  # the incoming gradient is not 1 (e.g. a loss divided by the accumulation steps)
    loss = chunked_lm_loss(h1, w1, labels, chunk_tokens=chunk)
    (loss * scale).backward()
    ref = _plain(h2, w2, labels)
    (ref * scale).backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12, msg=f"seed {seed}")
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12, msg=f"seed {seed}")


def test_model_loss_and_tied_weights_match_the_model_float64(seed):
    cfg = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "tie_word_embeddings": True, "name": "tied"}
    a = build(cfg, dtype=torch.float64, seed=seed % 1000)
    b = build(cfg, dtype=torch.float64, seed=seed % 1000)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 23), generator=g)
    labels = torch.randint(0, 97, (2, 23), generator=g)
    la = chunked_lm_loss(a.model(ids), a.lm_head.weight, labels, chunk_tokens=5)
    torch.testing.assert_close(a(ids, labels), la.detach(), rtol=1e-12, atol=1e-12)  # the model's own loss path
    lb = F.cross_entropy(b.lm_head(b.model(ids)).reshape(-1, 97), labels.reshape(-1))  # the model's loss, in float64
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb.to(la.dtype), rtol=1e-12, atol=1e-12)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_bf16_close_to_full_logits_and_no_grad_path(seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(45, 16, generator=g).bfloat16()
    weight = (torch.randn(300, 16, generator=g) * 0.2).bfloat16()
    labels = torch.randint(0, 300, (45,), generator=g)
    loss = chunked_lm_loss(hidden, weight, labels, chunk_tokens=8)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy((hidden @ weight.t()).float(), labels)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(chunked_lm_loss(hidden, weight, labels, chunk_tokens=8), ref, rtol=1e-5, atol=1e-5)


def test_shape_errors():
    with pytest.raises(ValueError, match="labels"):
        chunked_lm_loss(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden size"):
        chunked_lm_loss(torch.randn(2, 3, 4), torch.randn(5, 6), torch.zeros(2, 3, dtype=torch.long))
