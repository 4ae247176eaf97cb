"""Where an eager training step of agoq's LLaMA peaks, and what a plan's gradient storage changes there.

With a large vocabulary the forward + backward peak is inside the chunked LM loss's forward
(agoq.models.lm_loss), after every decoder layer has saved its activations and before backward has made any
gradient. Alive at that moment, beyond weights, masters, optimizer moments and the layers' saved activations
(t = micro-batch x seq tokens, S = seq, C hidden, D head dim, V vocabulary, e bytes per value of the model's
dtype, c = min(t, chunk tokens) the first chunk's tokens; the chunk default 2**25 // V keeps 128 MiB of float32
logits):

  final norm (plain RMSNorm, saved)   float32 input 4tC + float32 1/rms 4t + normalised e*t*C
  the loss's input (norm output)      e*t*C
  RoPE tables cos, sin [1, S, D]      2 * e*S*D     (saved by the layers, made once per step)
  token ids (saved by the embedding)  8t
  the loss's grad_hidden              e*t*C         (filled chunk by chunk, saved for backward)
  the loss's float32 grad_weight      4VC           (accumulated over chunks)
  one chunk's d_logits^T @ h          e*V*C         (the matmul's output in the model's dtype, added into
                                                     grad_weight in place: no float32 copy of it)
  the chunk's float32 logits/probs    4cV
    and their copy in the model dtype e*c*V         (absent when e = 4)

`head_peak_parts` lists them. For LLaMA-3-8B (V 128256, C 4096, D 128, micro-batch 1 x 4096, bf16, c 261):
  67,108,864 + 16,384 + 33,554,432 (norm) + 33,554,432 (input) + 2,097,152 (RoPE) + 32,768 (ids)
  + 33,554,432 (grad_hidden) + 2,101,346,304 (float32 grad_weight) + 1,050,673,152 (chunk product)
  + 133,899,264 (logits) + 66,949,632 (bf16 d_logits)
  = 3,522,786,816 bytes, of which 6VC = 3,152,019,456 do not depend on the tokens. (The loss once cast each
  chunk's product to float32 before adding it, 4VC = 2,101,346,304 bytes more; a profile made then recorded that
  head peak, `profiled_head_peak_bytes`, and its calibration is read against it.)

Gradient storage at that moment: the step starts with every .grad None, so bf16 gradients do not exist yet
(0 bytes), while QuanGrad's flat 8-bit buffer (agoq.runtime.comm.quangrad) is allocated for the whole run (all of its
bytes). The profiler calibrates on bf16-gradient steps against a static count that includes all bf16
gradients (agoq.profiler.memory: fixed = measured - weights - masters - bf16 gradients - moments - activations),
so its `fixed_bytes` carries minus the bf16 gradient bytes; a QuanGrad plan must add them back. Together:

  peak(mode, t) = weights + masters + moments + resident(mode) + layer activations(t) + head_peak(t) + workspace
  workspace     = fixed_bytes + outside_activation_bytes + bf16 gradient bytes - head_peak(t0)

(t0 the profiled tokens; resident(bf16) = 0, resident(quangrad8) = QuanGrad's bytes). `extra_bytes` returns
peak - (weights + masters + moments + gradients of the mode) - layer activations: `head_and_workspace_bytes`
(the same for every gradient mode) + `absent_gradient_bytes` (the bf16 gradients, for QuanGrad). agoq.search adds
the first to a plan's static bytes and already adds the second where it corrects the calibration for QuanGrad.
If the calibration step peaked in backward instead, with some bf16 gradients already made, the added-back bytes
over-state a QuanGrad plan's peak by those gradients (never under-state it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from agoq.models.loss_chunks import default_chunk_tokens


@dataclass(frozen=True)
class HeadShape:
    """Sizes of the chunked LM head and loss for one micro-batch: `tokens` = micro-batch x `seq`."""

    vocab: int
    hidden: int
    head_dim: int
    seq: int
    tokens: int
    elem_bytes: int = 2
    chunk_tokens: Optional[int] = None  # None: agoq.models.loss_chunks.default_chunk_tokens(vocab)

    @classmethod
    def from_config(cls, config: dict, micro_batch: int, seq: int, elem_bytes: int = 2) -> "HeadShape":
        """From a LlamaConfig dict (vocab_size, hidden_size, head_dim or hidden_size / num_attention_heads)."""
        heads = int(config.get("num_attention_heads") or 1)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return cls(int(config["vocab_size"]), int(config["hidden_size"]), head_dim, int(seq), int(micro_batch) * int(seq),
                   int(elem_bytes))

    def with_micro_batch(self, micro_batch: int) -> "HeadShape":
        return HeadShape(self.vocab, self.hidden, self.head_dim, self.seq, int(micro_batch) * self.seq,
                         self.elem_bytes, self.chunk_tokens)

    def as_dict(self) -> dict:
        return asdict(self)


def head_peak_parts(s: HeadShape) -> dict[str, int]:
    """Bytes alive at the chunked loss's forward peak beyond the decoder layers' saved activations and the model's
    state, by tensor (see the module docstring)."""
    e, t, C, V = s.elem_bytes, s.tokens, s.hidden, s.vocab
    c = min(t, s.chunk_tokens or default_chunk_tokens(V))
    cast = e != 4  # a float32 model's .to(float32) returns the tensor itself
    return {"final_norm": 4 * t * C + 4 * t + e * t * C, "loss_input": e * t * C, "rope_tables": 2 * e * s.seq * s.head_dim,
            "token_ids": 8 * t, "grad_hidden": e * t * C, "grad_weight_float32": 4 * V * C,
            "chunk_grad_weight": e * V * C,
            "chunk_logits_float32": 4 * c * V, "chunk_d_logits": e * c * V if cast else 0}


def head_peak_bytes(s: HeadShape) -> int:
    """Sum of `head_peak_parts`, in bytes."""
    return sum(head_peak_parts(s).values())


def head_shape_of(memory: dict, config: Optional[dict], micro_batch: int, seq: int, elem_bytes: int) -> Optional[HeadShape]:
    """The profile's chunked head at `micro_batch`: its memory section's `chunked_lm_head` (written by the profiler
    for agoq's models), else read from the model config (vocab_size and hidden_size); None when neither has it."""
    head = memory.get("chunked_lm_head")
    if head:
        return HeadShape(**{k: head[k] for k in HeadShape.__dataclass_fields__ if k in head}).with_micro_batch(micro_batch)
    if config and config.get("vocab_size") and config.get("hidden_size"):
        return HeadShape.from_config(config, micro_batch, seq, elem_bytes)
    return None


def absent_gradient_bytes(memory: dict, gradient_mode: str) -> float:
    """Gradient bytes the calibration's `fixed_bytes` holds as a credit that a plan under `gradient_mode` does not
    get: the bf16 gradients (gradients_bytes_bf16) for QuanGrad, whose buffer exists at the peak where the bf16
    calibration step had no gradient yet; 0 for bf16 and SDP4Bit (counted as in the calibration step)."""
    if gradient_mode != "quangrad8":
        return 0.0
    return float(memory.get("gradients_bytes_bf16") or memory.get("weights_bytes") or 0)


def head_and_workspace_bytes(memory: dict, head: Optional[HeadShape], micro_batch: int,
                             profiled_micro_batch: int) -> float:
    """`extra_bytes` without `absent_gradient_bytes` (the same for every gradient mode), in bytes:

      calibrated, agoq's head     fixed + outside + head_peak(t) - head_peak(t0)   (= head_peak(t) + workspace
                                                                                     - bf16 gradient bytes)
      calibrated, no head known   (fixed + outside) x micro-batch / profiled micro-batch
      not calibrated (CPU)        the larger of outside x micro-batch / profiled and head_peak(t) - bf16 gradient
                                  bytes (0 without a head): weights, masters, moments, resident gradients, layers
                                  and the head's tensors, nothing for workspace
    """
    ratio = micro_batch / profiled_micro_batch
    outside = float(memory.get("outside_activation_bytes") or 0)
    fixed = memory.get("fixed_bytes")
    if head is None:
        return (float(fixed or 0) + outside) * ratio
    now = head.with_micro_batch(micro_batch)
    if fixed is None:
        bf16_grads = float(memory.get("gradients_bytes_bf16") or memory.get("weights_bytes") or 0)
        return max(outside * ratio, head_peak_bytes(now) - bf16_grads)
    return float(fixed) + outside + head_peak_bytes(now) - profiled_head_peak_bytes(memory, head)


def profiled_head_peak_bytes(memory: dict, head: HeadShape) -> float:
    """The head's forward peak at the profiled micro-batch as the profile's `fixed_bytes` was calibrated with: the
    `peak_bytes` its memory section's `chunked_lm_head` recorded (profiles made while the loss cast each chunk's
    weight gradient to float32 before adding it recorded 4 V C bytes more, which their measured peak held), else
    `head_peak_bytes(head)`."""
    recorded = (memory.get("chunked_lm_head") or {}).get("peak_bytes")
    return float(recorded) if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) \
        else float(head_peak_bytes(head))


def removed_copy_bytes(memory: dict, head: Optional[HeadShape]) -> float:
    """Bytes a calibrated profile's recorded head peak holds above today's head at the profiled micro-batch: the
    float32 copy of a chunk's weight-gradient product that the loss made when the profile was measured (0 for a
    profile of today's loss, an uncalibrated one, or one without agoq's head)."""
    if head is None or memory.get("fixed_bytes") is None:
        return 0.0
    return max(0.0, profiled_head_peak_bytes(memory, head) - head_peak_bytes(head))


def extra_bytes(memory: dict, head: Optional[HeadShape], gradient_mode: str, micro_batch: int,
                profiled_micro_batch: int) -> float:
    """Bytes of the eager fwd + bwd peak beyond the static bytes of `gradient_mode` (weights, masters, moments and
    that mode's gradient storage) and the decoder layers' activations, at `micro_batch` (see the module
    docstring): head_and_workspace_bytes + absent_gradient_bytes. `memory` is the profile's memory section
    (fixed_bytes, outside_activation_bytes, gradients_bytes_bf16); `head` the chunked head at the profiled
    micro-batch (None: not agoq's chunked head).

    Calibrated with agoq's head this is head_peak(t) + workspace + resident(mode) - gradient bytes of the mode:
    for QuanGrad head_peak(t) + workspace, for bf16 head_peak(t) + workspace - the bf16 gradient bytes."""
    return head_and_workspace_bytes(memory, head, micro_batch, profiled_micro_batch) \
        + absent_gradient_bytes(memory, gradient_mode)


__all__ = ["HeadShape", "head_peak_parts", "head_peak_bytes", "head_shape_of", "profiled_head_peak_bytes",
           "removed_copy_bytes",
           "absent_gradient_bytes", "head_and_workspace_bytes", "extra_bytes"]
