"""Host memory for activation offload (agoq.runtime.activations.offload): the pool of pinned chunks its copies go to
(`HostPool`), the counts it keeps (`OffloadStats`), one offloaded tensor (`_Saved`) and the copies that rebuild it.

Strides are kept: a tensor comes back with the size, strides and dtype it was saved with (compiled backward code
checks them), dense tensors in one copy each way. On a CPU-only machine the "host" copy is an ordinary tensor and
every copy is synchronous: the same bookkeeping, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 512  # bytes: every pooled tensor starts at a multiple (any dtype's element size divides it)
CHUNK_BYTES = 256 << 20  # pinned chunks are made this large (a larger tensor gets a chunk of its own size)


class HostPool:
    """Host memory handed out front to back from chunks made once and taken back all at once (`reset`).

    `pin`: page-locked chunks (needed for asynchronous copies with a GPU). `budget_bytes` (None: no cap) bounds the
    chunks' total; `take` returns None when a tensor would pass it."""

    def __init__(self, *, pin: bool, budget_bytes: int | None = None, chunk_bytes: int = CHUNK_BYTES):
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"the host budget must be >= 0 bytes, got {budget_bytes}")
        self.pin, self.budget_bytes, self.chunk_bytes = pin, budget_bytes, chunk_bytes
        self.chunks: list[torch.Tensor] = []
        self._chunk, self._offset = 0, 0  # where the next tensor goes
        self.used_bytes = 0  # handed out since the last reset (alignment included)
        self.peak_used_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def reset(self) -> None:
        """Take every tensor back (the caller ensures no copy still reads or writes them)."""
        self._chunk, self._offset, self.used_bytes = 0, 0, 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of host memory as a uint8 tensor (None: the budget would be passed)."""
        need = -(-nbytes // ALIGN) * ALIGN
        while self._chunk < len(self.chunks):
            chunk = self.chunks[self._chunk]
            if self._offset + need <= chunk.numel():
                out = chunk[self._offset:self._offset + nbytes]
                self._offset += need
                self._used(need)
                return out
            self._chunk, self._offset = self._chunk + 1, 0  # the rest of this chunk stays unused this round
        size = max(self.chunk_bytes, need)
        if self.budget_bytes is not None and self.capacity_bytes + size > self.budget_bytes:
            size = need  # a last, exact chunk, if even that fits
            if self.capacity_bytes + size > self.budget_bytes:
                return None
        self.chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        self._chunk, self._offset = len(self.chunks) - 1, need
        self._used(need)
        return self.chunks[-1][:nbytes]

    def _used(self, nbytes: int) -> None:
        self.used_bytes += nbytes
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)


@dataclass
class OffloadStats:
    """Bytes moved, per micro-batch and in all: what left the GPU, what stayed for lack of host memory, and how
    often backward found a tensor's copy not yet started (fetched on demand) rather than prefetched."""

    offloaded_bytes: int = 0  # in all, each tensor counted once (it also comes back)
    offloaded_tensors: int = 0
    kept_on_gpu_bytes: int = 0  # eligible, but the host budget was reached
    fetched_on_demand: int = 0  # layers whose tensors were not prefetched when backward first asked
    fetched_ahead: int = 0  # layers started more than one layer early, into memory backward had freed
    never_unpacked: int = 0  # offloaded tensors backward did not ask for (saved by autograd, not used)
    micro_batches: int = 0
    bytes_per_layer: dict[int, int] = field(default_factory=dict)  # the last micro-batch's, by layer index

    def to_dict(self) -> dict[str, Any]:
        return {"offloaded_bytes": self.offloaded_bytes, "offloaded_tensors": self.offloaded_tensors,
                "kept_on_gpu_bytes": self.kept_on_gpu_bytes, "fetched_on_demand": self.fetched_on_demand,
                "fetched_ahead": self.fetched_ahead,
                "never_unpacked": self.never_unpacked,
                "micro_batches": self.micro_batches,
                "bytes_per_layer": {str(k): v for k, v in sorted(self.bytes_per_layer.items())}}


@dataclass
class _Saved:
    """One offloaded tensor: its host copy and what rebuilds it."""

    host: torch.Tensor  # 1-D dtype view of pooled host memory: the storage span (dense) or the contiguous values
    size: torch.Size
    stride: tuple[int, ...]
    dense: bool  # non-overlapping and dense: host holds it with the same strides
    device: torch.device
    layer: int
    copied: Any = None  # CUDA event: the device-to-host copy has ended
    gpu: torch.Tensor | None = None  # brought back, waiting for backward
    ready: Any = None  # CUDA event: the host-to-device copy has ended
    unpacked: bool = False


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _fill(out: torch.Tensor, e: _Saved, non_blocking: bool = False) -> torch.Tensor:
    """Copy `e`'s host values into `out` (made by empty_strided with e's size and strides): one memcpy into its
    storage span when dense, else into a contiguous buffer first (on the device, the current stream)."""
    if e.dense:
        out.as_strided((out.numel(),), (1,), 0).copy_(e.host, non_blocking=non_blocking)
    else:
        out.copy_(e.host.to(out.device, non_blocking=non_blocking).view(e.size))
    return out


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill their span exactly once (some order of its dimensions is contiguous): then a
    buffer of numel elements holds it with its own strides."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _tensors(items) -> list[torch.Tensor]:
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (tuple, list)):
            out += _tensors(item)
    return out
