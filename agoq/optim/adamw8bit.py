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
BUCKET_VALUES = 2**26  # values updated together (about 1 GiB of float32 temporaries)


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
        """One AdamW step over every parameter with a .grad; returns the closure's loss if given.

        Parameters with 8-bit moments are updated together, in buckets of up to 2**26 values laid end
        to end (each padded to whole blocks), so a step launches a few dozen kernels per bucket instead
        of a few dozen per parameter; the arithmetic is elementwise, hence identical either way.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hp = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
            batches: dict[tuple, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if self.state.get(p) else self._init_state(p)
                if "exp_avg_codes" in state:
                    key = (state["step"], p.dtype == torch.float64, p.device)
                    batches.setdefault(key, []).append((p, state))
                else:
                    self._step_exact(p, state, *hp)
            for items in batches.values():
                for bucket in self._buckets(items):
                    self._step_quantized(bucket, *hp)
        return loss

    def _buckets(self, items: list) -> list[list]:
        out, size = [[]], 0
        for p, state in items:
            n = -(-p.numel() // self.block) * self.block
            if out[-1] and size + n > BUCKET_VALUES:
                out.append([])
                size = 0
            out[-1].append((p, state))
            size += n
        return out

    @staticmethod
    def _step_exact(p, state, lr, beta1, beta2, eps, wd) -> None:
        """AdamW on one parameter whose moments are kept exactly."""
        dtype = state["exp_avg"].dtype
        grad = p.grad.to(dtype)
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

    def _step_quantized(self, items: list, lr, beta1, beta2, eps, wd) -> None:
        """AdamW on parameters with 8-bit moments and the same step count, laid end to end."""
        block = self.block
        first = items[0][0]
        dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        sizes = [p.numel() for p, _ in items]
        padded = [-(-n // block) * block for n in sizes]
        zeros = torch.zeros(block, dtype=dtype, device=first.device)

        def flat(tensors) -> torch.Tensor:
            pieces = []
            for t, n, length in zip(tensors, sizes, padded):
                pieces.append(t.reshape(-1).to(dtype))
                if length > n:
                    pieces.append(zeros[: length - n])
            return torch.cat(pieces)

        total = sum(padded)
        grad = flat([p.grad for p, _ in items])
        value = flat([p for p, _ in items])
        states = [st for _, st in items]
        exp_avg = dequantize_blocks(torch.cat([st["exp_avg_codes"] for st in states]),
                                    torch.cat([st["exp_avg_scales"] for st in states]), total, dtype)
        exp_avg_sq = dequantize_blocks(torch.cat([st["exp_avg_sqrt_codes"] for st in states]),
                                       torch.cat([st["exp_avg_sqrt_scales"] for st in states]), total,
                                       dtype).square_()
        step = states[0]["step"] + 1
        value.mul_(1.0 - lr * wd)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
        value.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1 ** step))
        m_codes, m_scales = quantize_blocks(exp_avg, block)
        r_codes, r_scales = quantize_blocks(exp_avg_sq.sqrt_(), block)
        offset = 0
        for (p, st), n, length in zip(items, sizes, padded):
            p.copy_(value[offset: offset + n].view_as(p))
            b0, b1 = offset // block, (offset + length) // block
            st["exp_avg_codes"], st["exp_avg_scales"] = m_codes[offset: offset + length], m_scales[b0:b1]
            st["exp_avg_sqrt_codes"], st["exp_avg_sqrt_scales"] = r_codes[offset: offset + length], r_scales[b0:b1]
            st["step"] = step
            offset += length

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
