"""The trainer's three optimizer steps: torch's AdamW on float32 masters, agoq's fused 8-bit AdamW, SDP4Bit's sharded AdamW.

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

    def step(self, grads, scale: float) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g.mul_(scale) if scale != 1.0 else g
        self.optimizer.step()


def build_optimizer(params: list[torch.Tensor], optim: OptimizerConfig, *, seed: int,
                    device: torch.device) -> OptimizerStep:
    """The optimizer of one process, DDP or a pipeline stage: 8-bit fused AdamW, or AdamW on masters."""
    if optim.optimizer == "adamw8bit":
        return FusedAdamW8bitStep(params, optim, seed)
    return AdamWWithMasters(params, optim, device)


def build_sharded_optimizer(params: list[torch.Tensor], optim: OptimizerConfig, *, seed: int, quantized: bool,
                            node_size: int | None) -> OptimizerStep:
    """The optimizer of `--parallel sharded` (SDP4Bit; `quantized`: int8/int4 gradients and weights)."""
    return ShardedAdamWStep(params, optim, seed, quantized, node_size)


__all__ = ["OptimizerStep", "build_optimizer", "build_sharded_optimizer", "BETAS", "EPS"]
