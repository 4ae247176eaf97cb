"""QuanGrad: gradients kept in one flat 8-bit block-quantized buffer, and its DDP communication hook.

`QuantizedGradients(params)` gives every parameter a block-aligned slice of an int8 buffer with one
float32 scale per block (about 1.02 bytes per value against 2 for bf16 gradients). As soon as
autograd has accumulated a parameter's gradient, a hook adds it into the buffer (dequantize, add in
float32, requantize) and drops the full-precision gradient, so whole-model gradients never exist in
16 or 32 bits. `all_reduce()` sums the buffer over the data-parallel group with the 8-bit all-reduce;
`to_grads()` gives the optimizer float32 gradients.
"""


from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from agoq.runtime.qtensor import QTensor, int_qmax, num_blocks
from agoq.runtime.quantize import dequantize, quantize
from agoq.runtime.quantized_allreduce import DEFAULT_BLOCK, all_reduce_codes, quantized_all_reduce

_ZERO_CODE = int_qmax(8)


def accumulate_reference(codes: torch.Tensor, scales: torch.Tensor, grad: torch.Tensor, block: int) -> None:
    """codes/scales (one param's whole blocks) += grad, in place: dequantize, add in float32, requantize."""
    n = grad.numel()
    current = dequantize(QTensor(codes, scales, codes.shape, torch.float32, 8, block), torch.float32)
    current[:n] += grad.reshape(-1).float()
    q = quantize(current, 8, block, check_finite=False)
    codes.copy_(q.data)
    scales.copy_(q.scales)


class QuantizedGradients:
    """The gradients of `params` in 8-bit storage (block `block`, float32 scales)."""

    def __init__(self, params: Iterable[nn.Parameter], block: int = DEFAULT_BLOCK, capture: bool = True):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("QuantizedGradients needs at least one parameter that requires grad")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self.block = block
        self.slices: list[tuple[int, int]] = []  # (first block, number of blocks) per parameter
        first = 0
        for p in self.params:
            nb = num_blocks(p.numel(), block)
            self.slices.append((first, nb))
            first += nb
        device = self.params[0].device
        self.codes = torch.full((first * block,), _ZERO_CODE, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(first, dtype=torch.float32, device=device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._capture) for p in self.params] if capture else []
        self._index = {id(p): i for i, p in enumerate(self.params)}

    @property
    def nbytes(self) -> int:
        """Bytes of gradient storage: codes plus scales."""
        return self.codes.numel() + 4 * self.scales.numel()

    def _views(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, nb = self.slices[i]
        return self.codes[first * self.block:(first + nb) * self.block], self.scales[first:first + nb]

    def _capture(self, p: nn.Parameter) -> None:
        self.add_(p, p.grad)
        p.grad = None

    def add_(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add `grad` (any float dtype) to `param`'s 8-bit gradient."""
        codes, scales = self._views(self._index[id(param)])
        accumulate_reference(codes, scales, grad.detach(), self.block)

    def zero_(self) -> None:
        """Set every gradient to zero."""
        self.codes.fill_(_ZERO_CODE)
        self.scales.zero_()

    def all_reduce(self, group=None, average: bool = True) -> None:
        """Sum (or average) the gradients over `group` with the 8-bit all-reduce; all ranks end identical."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        codes, scales = all_reduce_codes(self.codes, self.scales, self.codes.numel(), self.block, group)
        if average:
            scales = scales / dist.get_world_size(group)
        self.codes.copy_(codes)
        self.scales.copy_(scales)

    def gradient(self, param: nn.Parameter, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One parameter's gradient, dequantized, in its shape."""
        i = self._index[id(param)]
        codes, scales = self._views(i)
        flat = dequantize(QTensor(codes, scales, codes.shape, dtype, 8, self.block), dtype)
        return flat[: param.numel()].view(param.shape)

    def to_grads(self, dtype: torch.dtype = torch.float32) -> None:
        """Set every parameter's .grad to its dequantized gradient, for an optimizer step."""
        for p in self.params:
            p.grad = self.gradient(p, dtype)

    def remove(self) -> None:
        """Stop capturing gradients (the buffer stays readable)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def quangrad_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket with the 8-bit all-reduce.

    `ddp_model.register_comm_hook(process_group_or_None, agoq.quangrad_hook)`, beside torch's
    `bf16_compress_hook`. The state is the process group (None: the default group).
    """
    group = state if isinstance(state, dist.ProcessGroup) else None
    tensor = bucket.buffer()
    quantized_all_reduce(tensor, group=group, average=True)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
