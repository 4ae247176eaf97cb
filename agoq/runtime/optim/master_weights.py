"""float32 master copies of low-precision parameters: what the optimizer steps when the model runs in bf16.

`agoq train`, the profiler's measured step and the search's measured plans all keep their weights this
way, so the memory a profile predicts is the memory training holds:

    parameters (bf16)  +  masters (float32, 4 bytes per value)  +  optimizer state over the masters

Each step (`step`): `set_grads` hands the optimizer the gradients cast to float32, the optimizer steps the
masters, `write_back` rounds them into the parameters. Parameters already in float32 are their own masters.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


class MasterWeights:
    """The optimizer's targets for `params`: float32 copies when any parameter is not float32, else `params`."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.params = list(params)
        if all(p.dtype == torch.float32 for p in self.params):
            self.masters = None
        else:
            self.masters = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in self.params]

    @property
    def targets(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates."""
        return self.masters if self.masters is not None else self.params

    def set_grads(self, grads: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """Give every target its gradient, cast to the target's dtype and multiplied by `scale`."""
        for t, g in zip(self.targets, grads):
            g = g.to(t.dtype)
            t.grad = g.mul_(scale) if scale != 1.0 else g

    @torch.no_grad()
    def write_back(self) -> None:
        """Round the masters into the parameters (nothing to do without masters)."""
        if self.masters is not None:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def step(self, optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor] | None = None,
             scale: float = 1.0) -> None:
        """One optimizer step: `grads` (default: the parameters' .grad, zeros where None) x `scale` to the
        targets, `optimizer.step()`, then the masters rounded into the parameters."""
        if grads is None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.set_grads(grads, scale)
        optimizer.step()
        self.write_back()

    def zero_grad(self) -> None:
        """Drop every gradient of the parameters and the masters (they are allocated again by backward)."""
        for t in self.params + (self.masters or []):
            t.grad = None

    @staticmethod
    def bytes_for(params: Iterable[torch.Tensor]) -> int:
        """Bytes the float32 masters of `params` take (0 when they are all float32)."""
        params = list(params)
        if all(p.dtype == torch.float32 for p in params):
            return 0
        return 4 * sum(p.numel() for p in params)
