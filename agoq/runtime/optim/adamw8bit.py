"""AdamW with 8-bit moments: block-quantized first and second moments, the update computed in float32.

Each moment is kept as 8-bit floating-point codes (float8 e4m3: 3 mantissa bits, about 5 decades of
range) with one float32 scale per block of `block` values (the block's largest magnitude maps to 448,
the format's largest value). The first moment is stored as it is; the second moment is stored as its
square root, which halves the decades it must span and makes the stored quantity the one the update
divides by. A step reads both moments, the gradient and the parameter, runs the AdamW update in float32
and writes the parameter and the requantized moments in one pass (agoq.runtime.optim.fused_adamw: one Triton
launch per bucket of parameters on the GPU, its torch reference elsewhere): 2 bytes of state per value
plus 8 bytes per block, against 8 for float32 AdamW.

`FusedAdamW8bit` steps bf16 model parameters directly: it keeps their float32 masters in its state
(or none: bf16 parameters updated with stochastic rounding), reads QuanGrad's 8-bit gradients in
place and multiplies the clip factor into the gradient, so no float32 gradient exists.

Parameters with fewer than `min_8bit_numel` values (norm weights, biases) keep float32 moments: they
cost little and are the most sensitive.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, eps added to the
bias-corrected root of the second moment); with exact moments it is the same step to rounding.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from agoq.runtime.comm.quangrad import QuantizedGradients
from agoq.runtime.optim.fused_adamw import (adamw8bit_step, dequantize_blocks, quantize_blocks, sr_seed, stochastic_round_bf16,
                                    zero_blocks)

__all__ = ["AdamW8bit", "FusedAdamW8bit", "quantize_blocks", "dequantize_blocks"]


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
        self.seed = 0
        self.stochastic_rounding = False
        self._index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = 0
        if p.numel() >= self.min_8bit_numel:
            state["exp_avg_codes"], state["exp_avg_scales"] = zero_blocks(p.numel(), self.block, p.device)
            state["exp_avg_sqrt_codes"], state["exp_avg_sqrt_scales"] = zero_blocks(p.numel(), self.block, p.device)
        else:
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a .grad; returns the closure's loss if given.

        Parameters with 8-bit moments go through the fused step (agoq.runtime.optim.fused_adamw) in groups of
        one step count; on the GPU that is one kernel launch per bucket of up to 2**26 values.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            items = [(p, p.grad) for p in group["params"] if p.grad is not None]
            self._step_group(group, items, masters=False, clip=1.0, grad_block=self.block)
        return loss

    def _step_group(self, group: dict, items: list, masters: bool, clip: float, grad_block: int) -> None:
        """AdamW over (parameter, gradient) pairs of one group; a gradient is a dense tensor or QuanGrad's
        (codes, scales). With `masters`, a parameter whose state holds a float32 "master" is stepped there."""
        hp = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
        batches: dict[tuple, list] = {}
        exact: dict[tuple, list] = {}
        for p, g in items:
            state = self.state[p] if self.state.get(p) else self._init_state(p)
            if "exp_avg_codes" in state:
                batches.setdefault((state["step"], p.device), []).append((p, g, state))
            else:
                key = (state["step"], state["exp_avg"].dtype, p.dtype, p.device, "master" in state)
                exact.setdefault(key, []).append((p, g, state))
        for batch in exact.values():
            self._step_exact(batch, clip, **hp)
        for (step, _), batch in batches.items():
            params = [p for p, _, _ in batch]
            states = [st for _, _, st in batch]
            master_list = [st["master"] for st in states] if masters and "master" in states[0] else None
            seeds = None
            if self.stochastic_rounding and master_list is None:
                seeds = [sr_seed(self.seed, step + 1, self._index[id(p)]) for p in params]
            adamw8bit_step(params, master_list, [g for _, g, _ in batch], states, **hp, step=step + 1, clip=clip,
                           block=self.block, grad_block=grad_block, seeds=seeds)
            for st in states:
                st["step"] = step + 1

    def _step_exact(self, batch: list, clip, lr, betas, eps, weight_decay) -> None:
        """AdamW on parameters whose moments are kept exactly (float32; float64 for float64 parameters), all
        of one step count, dtype and device together: torch's foreach ops, a dozen launches for the whole
        batch (one parameter at a time, the norm weights of a large model cost hundreds)."""
        beta1, beta2 = betas
        params = [p for p, _, _ in batch]
        states = [st for _, _, st in batch]
        dtype = states[0]["exp_avg"].dtype
        grads = []
        for p, grad, _ in batch:
            if isinstance(grad, tuple):  # QuanGrad's codes and scales of a small parameter
                codes, scales = grad
                grad = ((codes.to(torch.int32) - 127).to(dtype).view(scales.numel(), -1)
                        * scales.to(dtype)[:, None]).reshape(-1)[: p.numel()].view(p.shape)
            grads.append(grad.to(dtype))
        if clip != 1.0:
            grads = torch._foreach_mul(grads, clip)
        exp_avgs = [st["exp_avg"] for st in states]
        exp_avg_sqs = [st["exp_avg_sq"] for st in states]
        step = states[0]["step"] + 1
        for st in states:
            st["step"] = step
        masters = [st.get("master") for st in states]
        values = [m if m is not None else p.to(dtype, copy=True) for m, p in zip(masters, params)]
        torch._foreach_mul_(values, 1.0 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, math.sqrt(1.0 - beta2 ** step))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(values, exp_avgs, denom, value=-lr / (1.0 - beta1 ** step))
        if masters[0] is None and params[0].dtype == torch.bfloat16 and self.stochastic_rounding:
            # one draw for the batch, seeded by the step and the batch's first parameter: a resume draws the
            # same bits
            sizes = [p.numel() for p in params]
            gen = torch.Generator(device=params[0].device)
            gen.manual_seed(sr_seed(self.seed, step, self._index[id(params[0])]))
            noise = torch.randint(0, 2**16, (sum(sizes),), generator=gen, dtype=torch.int32, device=params[0].device)
            flat = torch.cat([v.float().reshape(-1) for v in values])
            rounded = stochastic_round_bf16(flat, noise).split(sizes)
            torch._foreach_copy_(params, [r.view(p.shape) for r, p in zip(rounded, params)])
        else:
            torch._foreach_copy_(params, values)

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


class FusedAdamW8bit(AdamW8bit):
    """AdamW8bit over a model's own (bf16) parameters, with the clip factor and the gradient source fused in.

    `masters=True`: every parameter that is not float32 gets a float32 master in its state
    (`state["master"]`, 4 bytes per value), which the step updates and rounds (nearest even) into the
    parameter. `masters=False`: no master; bf16 parameters receive the float32 result stochastically
    rounded (seeded by `seed`, the step and the parameter's position: resumes draw the same bits).

    `step(grads=None | QuantizedGradients | list of tensors, clip_scale=s)` reads each parameter's
    gradient where it lives: QuanGrad's 8-bit codes and scales (no float32 gradient is ever built),
    the given tensors, or (None) the parameters' .grad; the gradient is multiplied by `clip_scale`.
    Parameters with fewer than `min_8bit_numel` values keep exact float32 moments (as AdamW8bit).
    The state format is AdamW8bit's plus "master"; `state_dict()` holds it as stored (8-bit codes).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, masters: bool = True, block: int = 256,
                 min_8bit_numel: int = 4096, seed: int = 0):
        super().__init__(params, lr, betas, eps, weight_decay, block=block, min_8bit_numel=min_8bit_numel)
        self.masters = masters
        self.seed = seed
        self.stochastic_rounding = not masters

    def _init_state(self, p: torch.Tensor) -> dict:
        state = super()._init_state(p)
        if self.masters and p.dtype != torch.float32:
            state["master"] = p.detach().to(torch.float32, copy=True)  # one float32 copy, no second one in passing
        return state

    @torch.no_grad()
    def step(self, closure=None, *, grads: QuantizedGradients | list[torch.Tensor] | None = None,
             clip_scale: float = 1.0):
        """One AdamW step of every parameter that has a gradient in `grads` (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        grad_block = self.block
        if isinstance(grads, QuantizedGradients):
            grads.wait()
            grad_block = grads.block
            held = {id(p) for p in grads.params}
            missing = [i for i, p in enumerate(params) if id(p) not in held]
            if missing:
                raise ValueError(f"the QuantizedGradients hold no gradient for parameters {missing[:5]} of this "
                                 "optimizer: build both over the same parameters")
            source = {id(p): grads.stored(p) for p in params}
        elif grads is None:
            source = {id(p): p.grad for p in params if p.grad is not None}
        else:
            grads = list(grads)
            if len(grads) != len(params):
                raise ValueError(f"{len(grads)} gradients for {len(params)} parameters")
            source = {id(p): g for p, g in zip(params, grads) if g is not None}
        for group in self.param_groups:
            items = [(p, source[id(p)]) for p in group["params"] if id(p) in source]
            self._step_group(group, items, masters=self.masters, clip=clip_scale, grad_block=grad_block)
        return loss

    def master_bytes(self) -> int:
        """Bytes of float32 masters held (0 without masters)."""
        return sum(s["master"].numel() * 4 for s in self.state.values() if "master" in s)
