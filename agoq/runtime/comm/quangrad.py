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

from agoq.runtime.comm.quantized_allreduce import (
    DEFAULT_BLOCK,
    all_reduce_codes,
    quantized_all_reduce,
)
from agoq.runtime.quant.layout import int_qmax, num_blocks
from agoq.runtime.quant.qtensor import QTensor
from agoq.runtime.quant.codec import dequantize, quantize

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
    """The gradients of `params` in 8-bit storage (block `block`, float32 scales).

    The buffer is laid out in reverse parameter order (the order backward produces gradients in) and
    cut into buckets of about `bucket_bytes` of storage. `all_reduce()` reduces bucket by bucket, so
    the temporary wire buffers stay bucket-sized. With `overlap=True`, call `prepare_sync()` before
    the last micro-batch's backward: each bucket's all-reduce then starts as soon as backward has
    delivered all of its gradients (on a side CUDA stream on the GPU), and `wait()` (or `to_grads()`)
    finishes them.
    """

    def __init__(self, params: Iterable[nn.Parameter], block: int = DEFAULT_BLOCK, capture: bool = True,
                 bucket_bytes: int = 25 * 2**20, overlap: bool = False, group=None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("QuantizedGradients needs at least one parameter that requires grad")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.block = block
        self.group = group
        self.overlap = overlap
        self.slices: list[tuple[int, int]] = [(0, 0)] * len(self.params)  # (first block, blocks) per parameter
        self.buckets: list[list[int]] = []  # parameter indices, in the order backward fills them
        first, size = 0, 0
        for i in reversed(range(len(self.params))):
            nb = num_blocks(self.params[i].numel(), block)
            if self.buckets and size + nb * (block + 4) <= bucket_bytes:
                self.buckets[-1].append(i)
                size += nb * (block + 4)
            else:
                self.buckets.append([i])
                size = nb * (block + 4)
            self.slices[i] = (first, nb)
            first += nb
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        device = self.params[0].device
        self._view_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.codes = torch.full((first * block,), _ZERO_CODE, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(first, dtype=torch.float32, device=device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._capture) for p in self.params] if capture else []
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._syncing = False
        self._pending: list[int] = []
        self._launched = 0
        self._average = True
        self._stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None

    @property
    def nbytes(self) -> int:
        """Bytes of gradient storage: codes plus scales."""
        return self.codes.numel() + 4 * self.scales.numel()

    def _views(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter i's codes and scales: views into the buffers, made once (a backward asks for every parameter's,
        and slicing costs host time on a path the GPU waits for)."""
        views = self._view_cache.get(i)
        if views is None:
            first, nb = self.slices[i]
            views = self._view_cache[i] = (self.codes[first * self.block:(first + nb) * self.block],
                                           self.scales[first:first + nb])
        return views

    def _bucket_range(self, b: int) -> tuple[int, int]:
        """(first block, blocks) of bucket b: its parameters' slices are adjacent."""
        firsts = [self.slices[i] for i in self.buckets[b]]
        lo = min(f for f, _ in firsts)
        return lo, sum(nb for _, nb in firsts)

    def _capture(self, p: nn.Parameter) -> None:
        i = self._index[id(p)]
        self.add_(p, p.grad)
        p.grad = None
        if self._syncing:
            b = self._bucket_of[i]
            self._pending[b] -= 1
            while self._launched < len(self.buckets) and self._pending[self._launched] == 0:
                self._reduce_bucket(self._launched)  # in bucket order on every rank
                self._launched += 1

    def add_(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add `grad` (any float dtype) to `param`'s 8-bit gradient (one fused kernel on the GPU)."""
        codes, scales = self._views(self._index[id(param)])
        if codes.is_cuda and self.block & (self.block - 1) == 0:
            from agoq.runtime.comm.quangrad_triton import accumulate_triton

            accumulate_triton(codes, scales, grad.detach(), self.block)
        else:
            accumulate_reference(codes, scales, grad.detach(), self.block)

    def zero_(self) -> None:
        """Set every gradient to zero."""
        self.wait()
        self.codes.fill_(_ZERO_CODE)
        self.scales.zero_()

    def _world(self, group) -> int:
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def _reduce_bucket(self, b: int) -> None:
        world = self._world(self.group)
        if world == 1:
            return
        first, nb = self._bucket_range(b)
        codes = self.codes[first * self.block:(first + nb) * self.block]
        scales = self.scales[first:first + nb]
        divisor = world if self._average else 1
        if self._stream is None:
            all_reduce_codes(codes, scales, codes.numel(), self.block, self.group, divisor)
            return
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            all_reduce_codes(codes, scales, codes.numel(), self.block, self.group, divisor)

    def prepare_sync(self, average: bool = True) -> None:
        """Reduce each bucket during the coming backward as soon as its gradients are all in (overlap)."""
        self.wait()
        self._syncing = True
        self._average = average
        self._pending = [len(members) for members in self.buckets]
        self._launched = 0

    def wait(self) -> None:
        """Finish an overlapped reduction: reduce the buckets backward did not complete, then join streams."""
        if not self._syncing:
            return
        self._syncing = False
        while self._launched < len(self.buckets):  # parameters that got no gradient this step
            self._reduce_bucket(self._launched)
            self._launched += 1
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def all_reduce(self, group=None, average: bool = True) -> None:
        """Sum (or average) the gradients over the group with the 8-bit all-reduce, bucket by bucket;
        all ranks end identical. (With prepare_sync() before backward, this only waits.)"""
        if self._syncing:
            self.wait()
            return
        if group is not None:
            self.group = group
        self._average = average
        for b in range(len(self.buckets)):
            self._reduce_bucket(b)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def scale_(self, factor: float) -> None:
        """Multiply every gradient by `factor`: each block's scale (value = (code - 127) * scale), codes unchanged."""
        self.wait()
        self.scales.mul_(factor)

    def stored(self, param: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        """`param`'s gradient as stored: (uint8 codes [blocks * block], float32 scales [blocks]), views of the
        buffer (value = (code - 127) * scale; values past param.numel() are zero padding)."""
        self.wait()
        return self._views(self._index[id(param)])

    def gradient(self, param: nn.Parameter, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One parameter's gradient, dequantized, in its shape."""
        self.wait()
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
