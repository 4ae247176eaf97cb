"""How many tokens the chunked LM head and loss (agoq.models.lm_loss) take at once.

Read by the loss itself and by the model of its memory (agoq.models.step_peak), which the search uses: this module
imports no torch.
"""

from __future__ import annotations

LOGIT_ELEMENTS_PER_CHUNK = 2**25  # 128 MiB of float32 logits per chunk


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's float32 logits hold at most LOGIT_ELEMENTS_PER_CHUNK (2**25) values
    (128 MiB): 2**25 // vocab_size, at least 1."""
    return max(1, LOGIT_ELEMENTS_PER_CHUNK // vocab_size)


__all__ = ["LOGIT_ELEMENTS_PER_CHUNK", "default_chunk_tokens"]
