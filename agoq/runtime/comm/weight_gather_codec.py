"""The wire format of FSDP2's quantized weight all-gather (agoq.runtime.comm.fsdp_weight_gather): one uint8
all-gather input per weight and rank, and its torch reference (the CPU path; `weight_gather_triton` is the fused
CUDA path, tested against this one).

A rank's shard has `numel` = ceil(R / W) * C values (FSDP2's padded shard of an R x C weight over W ranks: the
rank's rows, then zeros), rounded up to `padded` = ceil(numel / block) * block values. Its all-gather input is
`nbytes` = padded * bits / 8 + 4 * padded / block bytes:

- codes: per value c = q + qmax (uint8; int4: two per byte, the even value in the low nibble), where
  q = clamp(floor(v + 1/2), -qmax, qmax), v = x / s, s = absmax(block) / qmax, qmax = 2**(bits-1) - 1 (v = x
  when s = 0 or NaN; a NaN v is coded 0). With `hadamard` (int4), x is first multiplied by H = S / sqrt(32)
  (Sylvester +-1 matrix, orthonormal and symmetric) in groups of 32 consecutive values.
- scales: the blocks' s as float32, after the codes (4-byte aligned: padded * bits / 8 is a multiple of 16).

Dequantizing rank r's bytes gives (c - qmax) * s (times H again for int4, H @ H = I) in float32, rounded once to
the parameter dtype; the flat unsharded weight is value j of rank r at r * numel + j, for j < numel and
r * numel + j < R * C (FSDP2's padding rows and the block padding are dropped). A block holding inf or NaN gets
an inf / NaN scale and dequantizes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from agoq.runtime.comm.hadamard import GROUP, hadamard_matrix

SCALE_BYTES = 4


@dataclass(frozen=True)
class WireLayout:
    """Where a weight's codes and scales sit in one rank's all-gather input (see the module docstring)."""

    bits: int
    block: int
    hadamard: bool
    numel: int  # values of FSDP2's padded shard: ceil(R / W) * C
    padded: int  # numel rounded up to whole blocks
    total: int  # values of the unsharded weight: R * C

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def code_bytes(self) -> int:
        return self.padded * self.bits // 8

    @property
    def nblocks(self) -> int:
        return self.padded // self.block

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's all-gather input: codes, then float32 scales."""
        return self.code_bytes + SCALE_BYTES * self.nblocks


@lru_cache(maxsize=4096)
def wire_layout(bits: int, block: int, hadamard: bool, shape: tuple[int, ...], world: int) -> WireLayout:
    """The layout of an R x C... weight of `shape` sharded on dim 0 over `world` ranks."""
    row = 1
    for s in shape[1:]:
        row *= s
    numel = -(-shape[0] // world) * row
    padded = -(-numel // block) * block
    return WireLayout(bits, block, hadamard, numel, padded, shape[0] * row)


_MATRICES: dict[torch.device, torch.Tensor] = {}


def hadamard_on(device: torch.device) -> torch.Tensor:
    """The orthonormal 32x32 Walsh-Hadamard matrix (float32) on `device`, built once per device."""
    m = _MATRICES.get(device)
    if m is None:
        m = _MATRICES[device] = hadamard_matrix(device)
    return m


def quantize_shard_reference(local: torch.Tensor, lay: WireLayout) -> torch.Tensor:
    """This rank's shard (its first values; the rest of the padded shard is zeros) -> its all-gather input
    (uint8, lay.nbytes), in plain torch."""
    x = torch.zeros(lay.padded, dtype=torch.float32, device=local.device)
    x[:local.numel()] = local.detach().reshape(-1)
    if lay.hadamard:
        x = (x.view(-1, GROUP) @ hadamard_on(x.device)).reshape(-1)
    xb = x.view(lay.nblocks, lay.block)
    s = xb.abs().amax(dim=1, keepdim=True) / float(lay.qmax)
    v = torch.nan_to_num(xb / torch.where(s > 0, s, torch.ones_like(s)), nan=0.0)
    codes = (torch.floor(v + 0.5).clamp(-lay.qmax, lay.qmax) + lay.qmax).to(torch.uint8).reshape(-1)
    if lay.bits == 4:
        pairs = codes.view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    out = torch.empty(lay.nbytes, dtype=torch.uint8, device=local.device)
    out[:lay.code_bytes] = codes
    out[lay.code_bytes:].view(torch.float32).copy_(s.view(-1))
    return out


def dequantize_gather_reference(gathered: torch.Tensor, lay: WireLayout, world: int, out: torch.Tensor) -> None:
    """Every rank's all-gather input laid end to end (uint8, world * lay.nbytes) -> the flat unsharded weight,
    written into `out` (lay.total values, contiguous, of the parameter dtype), in plain torch."""
    rows = gathered.reshape(world, lay.nbytes)
    codes = rows[:, :lay.code_bytes]
    if lay.bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(world, lay.padded)
    scales = rows[:, lay.code_bytes:].contiguous().view(torch.float32)  # [world, nblocks]
    values = (codes.to(torch.float32) - lay.qmax).view(world, lay.nblocks, lay.block) * scales[..., None]
    if lay.hadamard:
        values = values.reshape(-1, GROUP) @ hadamard_on(values.device)
    values = values.reshape(world, lay.padded)[:, :lay.numel].reshape(-1)[:lay.total]
    out.view(-1).copy_(values)


__all__ = ["WireLayout", "wire_layout", "quantize_shard_reference", "dequantize_gather_reference"]
