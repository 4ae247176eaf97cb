"""Pipeline parallelism: one stage of an agoq LlamaForCausalLM per rank, run by torch.distributed.pipelining (1F1B).

Stage 0 holds the embedding, the last stage the final norm and the LM head (its loss is the chunked
cross-entropy); each holds a contiguous run of decoder layers, which keep the activation settings
(bits per kind, checkpointing) applied to the whole model before it is cut, so each stage runs its own
stage-aware bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from agoq.models.lm_loss import chunked_lm_loss


class StageModule(nn.Module):
    """Decoder layers `layers` of `model`, with the embedding on the first stage and norm + head on the last."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool):
        super().__init__()
        if model.config.tie_word_embeddings and not (first and last):
            raise ValueError("a model with tied embeddings cannot be cut into pipeline stages (its embedding and "
                             "LM head would live on different ranks)")
        self.first, self.last = first, last
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = model.model.rotary_emb
        self.layer_indices = list(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] (first stage) or hidden states [B, S, C] in; hidden states out (normed on the last)."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        return x

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the head on this (last) stage's output."""
        return chunked_lm_loss(hidden, self.lm_head.weight, labels)


class Pipeline:
    """This rank's stage and its 1F1B schedule over `micro_batches` micro-batches per step."""

    def __init__(self, model: nn.Module, layer_stage: list[int], rank: int, world: int, micro_batches: int,
                 device: torch.device, micro_batch: int, seq_len: int, dtype: torch.dtype):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if micro_batches < world:
            raise ValueError(f"the 1F1B schedule needs at least as many micro-batches per step as pipeline stages: "
                             f"--grad-accum {micro_batches} < {world} stages")
        self.rank, self.world = rank, world
        layers = [i for i, s in enumerate(layer_stage) if s == rank]
        self.module = StageModule(model, layers, first=rank == 0, last=rank == world - 1)
        # static shapes: the stages exchange [micro_batch, seq_len, hidden] activations, known in advance
        # (requires_grad marks the received activations as needing a gradient sent back)
        hidden = torch.empty(micro_batch, seq_len, model.config.hidden_size, dtype=dtype, device=device,
                             requires_grad=True)
        first_input = torch.zeros(micro_batch, seq_len, dtype=torch.int64, device=device)
        self.stage = PipelineStage(self.module, rank, world, device,
                                   input_args=(first_input if rank == 0 else hidden,), output_args=(hidden,))
        # every stage passes the loss function: the schedule runs backward only when it has one
        self.schedule = Schedule1F1B(self.stage, micro_batches, loss_fn=self.module.loss)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one step's micro-batches (stacked); the mean loss on the last stage, else None."""
        if self.module.first:
            self.schedule.step(input_ids)
            return None
        if self.module.last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=labels, losses=losses)
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        self.schedule.step()
        return None

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor, hidden_size: int,
                 dtype: torch.dtype) -> torch.Tensor | None:
        """Forward only, hidden states passed on with send/recv; the mean loss on the last stage, else None."""
        if self.module.first:
            x = input_ids
        else:
            x = torch.empty(*input_ids.shape, hidden_size, dtype=dtype, device=input_ids.device)
            dist.recv(x, src=self.rank - 1)
        y = self.module(x)
        if not self.module.last:
            dist.send(y.contiguous(), dst=self.rank + 1)
            return None
        return self.module.loss(y, labels).float()
