"""LM head and cross-entropy over chunks of tokens: the full float32 logits never exist at once.

`chunked_lm_loss(hidden, weight, labels)` equals
`F.cross_entropy((hidden @ weight.T).float().view(-1, V), labels.view(-1), ignore_index=-100)`
(the loss of `LlamaForCausalLM`), but computes logits for `chunk_tokens` tokens at a time. The
gradients of each chunk are computed in the forward pass, right after its loss (softmax minus one-hot
is all the backward needs), so backward only scales them by the incoming gradient: nothing of size
tokens x vocab is saved, and the head's matmul runs once per chunk and direction, not twice.
"""

from __future__ import annotations

import torch

from agoq.models.loss_chunks import default_chunk_tokens

IGNORE_INDEX = -100


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, grad_enabled):
        n = hidden.shape[0]
        valid = labels != IGNORE_INDEX
        count = valid.sum()  # stays on the device: no host sync, and torch.compile traces on
        want_grad = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        total = torch.zeros((), dtype=torch.float32 if hidden.dtype != torch.float64 else torch.float64,
                            device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad and ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=total.dtype, device=weight.device) \
            if want_grad and ctx.needs_input_grad[1] else None
        for start in range(0, n, chunk_tokens):
            h = hidden[start:start + chunk_tokens]
            y = labels[start:start + chunk_tokens]
            ok = valid[start:start + chunk_tokens]
            logits = (h @ weight.t()).to(total.dtype)  # [chunk, V], the head's output cast up as the plain loss does
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(ok, lse - target, torch.zeros_like(lse)).sum()
            if want_grad:
                # d(sum of losses)/d logits = softmax - one_hot, zero on ignored rows
                probs = logits.sub_(lse.unsqueeze(1)).exp_()
                probs[torch.arange(probs.shape[0], device=probs.device), y.clamp(min=0)] -= 1.0
                probs.mul_(ok.unsqueeze(1).to(probs.dtype))
                d_logits = probs.to(hidden.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:start + chunk_tokens] = d_logits @ weight
                if grad_weight is not None:  # added in place: the product is cast element by element, no
                    grad_weight.add_(d_logits.t() @ h)  # float32 copy of it (4 V C bytes) is ever made
        denom = count.clamp(min=1).to(total.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(denom, *(t for t in (grad_hidden, grad_weight) if t is not None))
        ctx.has = (grad_hidden is not None, grad_weight is not None)
        # every label ignored: NaN, like F.cross_entropy
        return torch.where(count > 0, total / denom, torch.full_like(total, float("nan")))

    @staticmethod
    def backward(ctx, grad_out):
        # indexed, not popped: Dynamo (torch 2.11) sees saved_tensors as a tuple and breaks the graph on pop
        saved = ctx.saved_tensors
        scale = grad_out / saved[0]
        gh = gw = None
        i = 1
        if ctx.has[0]:
            gh = saved[i] * scale.to(saved[i].dtype)
            i += 1
        if ctx.has[1]:
            gw = saved[i] * scale.to(saved[i].dtype)
        return gh, gw, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the LM head `weight` [V, C] applied to `hidden` [..., C] against `labels` [...].

    Labels equal to -100 are ignored (the mean is over the others). Returns a float32 scalar (float64
    for float64 inputs). `chunk_tokens` tokens are processed at a time (default: 128 MiB of logits).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match "
                         "(labels must be one per token)")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} differs from the head's input size {weight.shape[1]}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return _ChunkedLMLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), int(chunk),
                                torch.is_grad_enabled())

