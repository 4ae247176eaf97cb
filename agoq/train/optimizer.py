"""The trainer's optimizer steps: torch's AdamW on float32 masters, agoq's fused 8-bit AdamW (also on FSDP2's
local shards), SDP4Bit's sharded AdamW.

Each is an `OptimizerStep`: `.optimizer` (what the checkpoint saves), `.masters` (float32 copies kept beside
the optimizer, or None), `.fused` (whether `step` reads the gradients as stored, QuanGrad's codes
included) and `step(grads, scale)`, which applies the gradients multiplied by the clip factor `scale`.
"""

from __future__ import annotations

import torch

from agoq.optim.master_weights import MasterWeights
from agoq.train.config import OptimizerConfig

BETAS = (0.9, 0.95)
EPS = 1e-8


class OptimizerStep:
    """An optimizer and how the loop hands it one step's gradients."""

    fused = False
    optimizer: torch.optim.Optimizer
    masters: list[torch.Tensor] | None = None

    def zero_grad(self) -> None:
        """Drop the gradients the optimizer keeps beside the parameters' (none by default)."""

    def step(self, grads, scale: float) -> None:
        raise NotImplementedError


class AdamWWithMasters(OptimizerStep):
    """torch's AdamW on float32 masters of non-float32 parameters, rounded back after each step."""

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig, device: torch.device):
        self.weights = MasterWeights(params)
        self.masters = self.weights.masters
        # torch's fused kernel on the GPU (one launch for all parameters), its default elsewhere
        self.optimizer = torch.optim.AdamW(self.weights.targets, lr=optim.lr, betas=BETAS, eps=EPS,
                                           weight_decay=optim.weight_decay, fused=device.type == "cuda" or None)

    def zero_grad(self) -> None:
        if self.masters is not None:
            self.weights.zero_grad()

    def step(self, grads, scale: float) -> None:
        self.weights.step(self.optimizer, grads, scale)


class FusedAdamW8bitStep(OptimizerStep):
    """One fused pass per bucket: gradients read where they live (QuanGrad's codes or .grad), the clip factor
    multiplied in, float32 masters (--master fp32) kept in the optimizer's state."""

    fused = True

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig, seed: int):
        from agoq.optim.adamw8bit import FusedAdamW8bit

        self.optimizer = FusedAdamW8bit(params, lr=optim.lr, betas=BETAS, eps=EPS, weight_decay=optim.weight_decay,
                                        masters=optim.master == "fp32", seed=seed)

    def step(self, grads, scale: float) -> None:
        self.optimizer.step(grads=grads, clip_scale=scale)


class ShardedAdamWStep(OptimizerStep):
    """SDP4Bit's sharded AdamW (float32 moments, 1/N per rank); it reduces the gradients itself."""

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig, seed: int, quantized: bool,
                 node_size: int | None):
        from agoq.optim.sdp4bit import SDP4BitOptimizer

        self.params = params
        self.optimizer = SDP4BitOptimizer(params, lr=optim.lr, betas=BETAS, eps=EPS, weight_decay=optim.weight_decay,
                                          quantize_gradients=quantized, quantize_weights=quantized, seed=seed,
                                          on_nonfinite="raise", node_size=node_size)

    def reduce(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shard of the averaged gradient (one float32 tensor, in a list): what the clip norm
        and `step` read. Non-finite values are not refused here: they reach the norm, which stops the run."""
        return [self.optimizer.reduce_gradients(grads, check_finite=False)]

    def step(self, grads, scale: float) -> None:
        self.optimizer.apply_reduced(grads[0], scale)


class FSDPAdamW8bitStep(FusedAdamW8bitStep):
    """agoq's fused 8-bit AdamW on each rank's local shards of FSDP2's parameters (plain tensors that share
    the DTensors' storage): the moments are block-quantized per shard; float32 shards are their own masters."""

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig, seed: int):
        from agoq.optim.adamw8bit import FusedAdamW8bit

        self.optimizer = FusedAdamW8bit([p.to_local().detach() for p in params], lr=optim.lr, betas=BETAS, eps=EPS,
                                        weight_decay=optim.weight_decay, masters=optim.master == "fp32", seed=seed)

    def step(self, grads, scale: float) -> None:
        self.optimizer.step(grads=[g.to_local() for g in grads], clip_scale=scale)


def build_optimizer(params: list[torch.Tensor], optim: OptimizerConfig, *, seed: int,
                    device: torch.device) -> OptimizerStep:
    """The optimizer of one process, DDP or a pipeline stage: 8-bit fused AdamW, or AdamW on masters."""
    if optim.optimizer == "adamw8bit":
        return FusedAdamW8bitStep(params, optim, seed)
    return AdamWWithMasters(params, optim, device)


def build_fsdp_optimizer(params: list[torch.Tensor], optim: OptimizerConfig, *, seed: int,
                         device: torch.device) -> OptimizerStep:
    """The optimizer of `--parallel fsdp` over FSDP2's sharded parameters (DTensors): torch's AdamW on them,
    or agoq's fused 8-bit AdamW on their local shards."""
    if optim.optimizer == "adamw8bit":
        return FSDPAdamW8bitStep(params, optim, seed)
    return AdamWWithMasters(params, optim, device)


def build_sharded_optimizer(params: list[torch.Tensor], optim: OptimizerConfig, *, seed: int, quantized: bool,
                            node_size: int | None) -> OptimizerStep:
    """The optimizer of `--parallel sharded` (SDP4Bit; `quantized`: int8/int4 gradients and weights)."""
    return ShardedAdamWStep(params, optim, seed, quantized, node_size)


__all__ = ["OptimizerStep", "build_optimizer", "build_fsdp_optimizer", "build_sharded_optimizer", "BETAS", "EPS"]
