"""AdamW with 8-bit moments: block-quantized first and second moments, the update computed in float32.

Each moment is kept as 8-bit floating-point codes (float8 e4m3: 3 mantissa bits, about 5 decades of
range) with one float32 scale per block of `block` values (the block's largest magnitude maps to 448,
the format's largest value). The first moment is stored as it is; the second moment is stored as its
square root, which halves the decades it must span and makes the stored quantity the one the update
divides by. A step dequantizes both moments of a parameter, runs the AdamW update in float32 (float64
for float64 parameters), writes the parameter, and requantizes: 2 bytes of state per value plus
8 bytes per block, against 8 for float32 AdamW.

Parameters with fewer than `min_8bit_numel` values (norm weights, biases) keep float32 moments: they
cost little and are the most sensitive.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, eps added to the
bias-corrected root of the second moment); with exact moments it is the same step to rounding.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes [n padded to blocks], float32 scales [blocks]) of a flat float tensor, float8 e4m3 per block."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    rows = padded.view(blocks, block)
    absmax = rows.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    codes = (rows / scales.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(torch.uint8).reshape(-1), scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, numel: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat tensor of `numel` values that `quantize_blocks` stored, in `dtype`."""
    rows = codes.view(FP8).view(scales.numel(), -1).to(dtype)
    return (rows * scales.to(dtype).unsqueeze(1)).reshape(-1)[:numel]


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are stored in 8 bits per value (see the module docstring).

    Same hyperparameters as torch.optim.AdamW (lr, betas, eps, weight_decay), plus `block` (values per
    scale, default 256) and `min_8bit_numel` (smaller parameters keep float32 moments, default 4096).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, block: int = 256, min_8bit_numel: int = 4096):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.block = block
        self.min_8bit_numel = min_8bit_numel

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = 0
        if p.numel() >= self.min_8bit_numel:
            zeros = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            state["exp_avg_codes"], state["exp_avg_scales"] = quantize_blocks(zeros, self.block)
            state["exp_avg_sqrt_codes"], state["exp_avg_sqrt_scales"] = quantize_blocks(zeros, self.block)
        else:
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a .grad; returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if self.state.get(p) else self._init_state(p)
                dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                grad = p.grad.to(dtype)
                quantized = "exp_avg_codes" in state
                if quantized:
                    n = p.numel()
                    exp_avg = dequantize_blocks(state["exp_avg_codes"], state["exp_avg_scales"], n, dtype).view(p.shape)
                    exp_avg_sq = dequantize_blocks(state["exp_avg_sqrt_codes"], state["exp_avg_sqrt_scales"], n,
                                                   dtype).view(p.shape).square_()
                else:
                    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = state["step"]
                value = p.to(dtype)
                value.mul_(1.0 - lr * wd)
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
                value.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1 ** step))
                p.copy_(value)
                if quantized:
                    state["exp_avg_codes"], state["exp_avg_scales"] = quantize_blocks(exp_avg, self.block)
                    state["exp_avg_sqrt_codes"], state["exp_avg_sqrt_scales"] = quantize_blocks(exp_avg_sq.sqrt_(),
                                                                                                self.block)
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (codes, scales, float32 moments)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict()`, keeping the stored dtypes (torch would cast the scales to the parameter's)."""
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)
