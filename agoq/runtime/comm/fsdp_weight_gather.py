"""FSDP2's weight all-gather in int8 (or int4 after a Hadamard transform): ZeRO++'s qwZ inside `fully_shard`.

`apply_weight_gather(model, bits=8, block=256)` wraps each weight matrix (every parameter of 2 or more
dimensions) in `QuantizedGatherWeight` before `fully_shard`; FSDP2 then shards the wrapper (dim 0, as always)
and, at every unshard (forward, and backward's re-gather after `reshard_after_forward`), calls its all-gather
hooks instead of sending the shard in `param_dtype`:

- `fsdp_pre_all_gather(mesh)`: this rank's shard, read as FSDP2's padded shard of R_pad = ceil(R / W) rows
  (R rows over W ranks, torch.chunk's split; the missing rows are zeros) and then whole blocks,
  n_pad = ceil(R_pad * C / block) * block values, block-quantized (symmetric absmax, one float32 scale per
  `block` values, nearest rounding: code q = floor(x / s + 1/2) clamped to +-qmax, s = absmax / qmax,
  qmax = 2**(bits-1) - 1) -> ONE all-gather input: uint8, the packed codes (n_pad * bits / 8 bytes) then
  the scales (4 bytes per block); `weight_gather_codec` gives the exact layout. With bits=4 the values are
  Hadamard-32 transformed before quantizing (`hadamard`), so an outlier spreads over its 32-group instead of
  setting a coarse scale for its block. On CUDA it is one fused Triton kernel (`weight_gather_triton`): the
  padding is a masked load and the transform a product in registers, so no padded, float32 or transformed
  copy of the shard is made; elsewhere the torch reference.
- `fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`: the W ranks' bytes -> q * s
  (inverse-transformed for int4) in `param_dtype`, value j of rank r at r * R_pad * C + j for j < R_pad * C
  (the first R * C values kept): the unsharded weight the forward and backward compute with. On CUDA one
  kernel writes it straight into `out` (FSDP2's unsharded parameter, after the first gather) with the padding
  dropped by masked stores: no full-size temporary. The gathered bytes are then freed (FSDP2 allocates them
  again at the next unshard), so an unsharded weight holds param_dtype's 2 bytes per value, as with FSDP2's
  own gather, not 2 + 1.016.

Per value the gathered weight differs from the sharded one by at most s / 2 (+ the rounding to param_dtype),
s = its block's absmax / qmax (int8: absmax / 254 at worst; int4 after Hadamard: the bound holds in the
transformed domain, and the orthonormal inverse keeps each 32-group's L2 error below sqrt(32) * s / 2).
Gradients are FSDP2's own: autograd differentiates the loss at the dequantized weight, FSDP2 reduce-scatters
that gradient (in `reduce_dtype`) into the sharded float parameter, and the optimizer steps the unquantized
shard (the straight-through estimator of quantization-aware training, with the quantizer only on the wire).
Bytes per gathered value: bits / 8 + 4 / block (int8, block 256: 1.016 vs bf16's 2; int4: 0.516). Work per
unshard of an N-value weight on W ranks: the quantize reads N / W values and writes N / W * (bits / 8 + 4 / block)
bytes; the dequantize reads N * (bits / 8 + 4 / block) bytes and writes 2N (bf16); int4 adds 2 x 32 multiply-adds
per value (IEEE float32).

The hook uses FSDP2's one-argument form `fsdp_pre_all_gather(self, mesh)` (torch 2.4 to at least 2.13 call
it; the five-argument form `(mesh, outer_size, outer_stride, module, mp_policy)` requires every all-gather
input of an unevenly sharded parameter to have the padded shard's shape, which a byte buffer cannot): the
wrapper pads to FSDP2's padded shard itself, knowing the full shape it was made from. Only dim-0 sharding
is supported, and `reshard_after_forward` must be a bool (FSDP2 does not call the hooks from its
post-forward shards of an int `reshard_after_forward`).

Outside the gather the wrapper behaves as the tensor it wraps: views, chunks, copies and new tensors made
from it (what FSDP2 does to shard and pad it) stay wrapped, in-place updates (the optimizer's) go to the
wrapped tensor, any other operation returns a plain tensor. `unwrap(t)` gives the plain tensor (for kernels
that need a data pointer: agoq's fused 8-bit AdamW). Per step the wrapper's Python dispatch runs only for the
optimizer's in-place updates of the shards (one call per foreach or fused kernel, e.g. one for torch's fused
AdamW): FSDP2's copy-in reads the hook's plain bytes, and forward and backward compute with the plain
unsharded tensors the post hook writes. FSDP2's first (lazy) initialisation copies a wrapped uneven shard into
new padded storage; `fully_shard_quantized` runs it at sharding time, so optimizers built afterwards hold the
final local tensors (with your own `fully_shard` calls, build an optimizer that captures `unwrap(p)` after the
first forward).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

from agoq.runtime.comm.weight_gather_codec import (WireLayout, dequantize_gather_reference, quantize_shard_reference,
                                                   wire_layout)
from agoq.runtime.quant.layout import check_arguments

DEFAULT_BLOCK = 256  # values per float32 scale: 1.6 % of int8's bytes


@dataclass(frozen=True)
class GatherSpec:
    """How a weight is gathered: `bits`-bit codes, one scale per `block` values, Hadamard-32 before quantizing
    (`hadamard`); `shape`, the full (unsharded) shape the wrapper was made from."""

    bits: int
    block: int
    hadamard: bool
    shape: tuple[int, ...]

    def padded_rows(self, world: int) -> int:
        """FSDP2's padded shard rows over `world` ranks: ceil(R / world) (torch.chunk's chunk size)."""
        return -(-self.shape[0] // world)

    def shard_numel(self, world: int) -> tuple[int, int]:
        """(values of a padded shard, those values rounded up to whole blocks) over `world` ranks."""
        lay = self.layout(world)
        return lay.numel, lay.padded

    def layout(self, world: int) -> WireLayout:
        """Where this weight's codes and scales sit in a rank's all-gather input over `world` ranks."""
        return wire_layout(self.bits, self.block, self.hadamard, self.shape, world)


# ops whose tensor results stay wrapped: views, and how FSDP2 shards, pads and moves a parameter. Not zeros_like,
# empty_like or clone: the optimizer's moments made like a parameter are plain tensors
_KEEP = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
         torch.ops.aten._unsafe_view.default, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
         torch.ops.aten.chunk.default, torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default,
         torch.ops.aten.as_strided.default, torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default,
         torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default}


class QuantizedGatherWeight(torch.Tensor):
    """A float tensor whose FSDP2 all-gather sends block-quantized codes and scales (see the module docstring)."""

    _data: torch.Tensor
    _spec: GatherSpec

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec: GatherSpec):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   layout=data.layout, device=data.device,
                                                   requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, spec: GatherSpec):
        self._data = data
        self._spec = spec

    def __repr__(self) -> str:
        s = self._spec
        return f"QuantizedGatherWeight(int{s.bits}, block={s.block}, hadamard={s.hadamard}, {self._data!r})"

    def __reduce_ex__(self, protocol):
        return self._data.__reduce_ex__(protocol)  # saved (checkpoints) as the plain tensor: loads without agoq

    def __tensor_flatten__(self):
        return ["_data"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return QuantizedGatherWeight(inner["_data"], spec)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrappers: dict[int, QuantizedGatherWeight] = {}

        def unwrap(t: QuantizedGatherWeight) -> torch.Tensor:
            wrappers[id(t._data)] = t
            return t._data

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        spec = next(iter(wrappers.values()))._spec

        def rewrap(t: torch.Tensor):
            if id(t) in wrappers and wrappers[id(t)]._data is t:
                return wrappers[id(t)]  # an in-place op's result: the wrapper it updated
            return cls(t, spec) if func in _KEEP and t.is_floating_point() else t

        return pytree.tree_map_only(torch.Tensor, rewrap, out)

    # ---------------------------------------------------------------- FSDP2's all-gather extension

    def fsdp_pre_all_gather(self, mesh):
        """This rank's padded shard -> its one all-gather input (uint8 codes, then float32 scales); the world
        size as metadata."""
        spec, local = self._spec, self._data
        if local.shape[1:] != spec.shape[1:]:
            raise NotImplementedError(f"the quantized weight all-gather shards dim 0 only: a shard of shape "
                                      f"{tuple(local.shape)} of a {spec.shape} weight; drop FSDP2's "
                                      "shard_placement_fn or --weight-gather")
        world = mesh.size()
        return (quantize_shard(local, spec.layout(world)),), world

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """Every rank's bytes -> the unsharded weight in `param_dtype` (flat, R * C values; FSDP2 views it in the
        parameter's shape), dequantized straight into `out` when FSDP2 passes the unsharded parameter back.
        The gathered bytes are freed at once (FSDP2 allocates them again before the next all-gather): while the
        weight is unsharded only the weight itself is held, as with FSDP2's own gather."""
        (gathered,) = all_gather_outputs
        world = metadata
        lay = self._spec.layout(world)
        if out is None:
            full = torch.empty(lay.total, dtype=param_dtype, device=gathered.device)
            dequantize_gather(gathered, lay, world, full)
            result = full, (full,)
        else:  # `.data`: the same storage, not the version autograd checks for saved tensors
            dequantize_gather(gathered, lay, world, out.data)
            result = None
        # the kernel reading them is queued on this stream, where the caching allocator alone reuses the block
        gathered.untyped_storage().resize_(0)
        return result


# FSDP2 reads the pre hook's signature at every unshard of every weight (inspect.signature: ~14 us from the source,
# ~5 us from a stored one)
QuantizedGatherWeight.fsdp_pre_all_gather.__signature__ = inspect.signature(QuantizedGatherWeight.fsdp_pre_all_gather)


def gathered_weight(gathered: torch.Tensor, spec: GatherSpec, world: int, dtype: torch.dtype) -> torch.Tensor:
    """The flat unsharded weight (R * C values in `dtype`) from the `world` ranks' all-gather inputs laid end to
    end: each rank's padded chunk dequantized (and inverse-transformed), its first values laid end to end."""
    lay = spec.layout(world)
    full = torch.empty(lay.total, dtype=dtype, device=gathered.device)
    dequantize_gather(gathered, lay, world, full)
    return full


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a QuantizedGatherWeight (a DTensor's local one included); `t` itself otherwise."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t._data if isinstance(t, QuantizedGatherWeight) else t


def apply_weight_gather(model: nn.Module, *, bits: int = 8, block: int = DEFAULT_BLOCK,
                        hadamard: bool | None = None, min_dims: int = 2) -> int:
    """Wrap every parameter of `model` with at least `min_dims` dimensions so that FSDP2 all-gathers it as
    `bits`-bit block codes (8, or 4 with the Hadamard transform; `hadamard` defaults to bits < 8), one float32
    scale per `block` values. Call it before `fully_shard`, after any dtype change of the parameters; a
    parameter shared by several modules is wrapped once. Returns how many parameters were wrapped.
    (Without FSDP2 the wrapped model computes as before, with exact weights.)"""
    if bits not in (4, 8):
        raise ValueError(f"the quantized weight all-gather sends 8-bit or 4-bit codes, got bits={bits!r}")
    check_arguments(bits, block, "nearest", "int")
    hadamard = bits < 8 if hadamard is None else bool(hadamard)
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.dim() < min_dims or not p.is_floating_point():
                continue
            if id(p) not in done:
                if isinstance(p, QuantizedGatherWeight) or hasattr(p, "to_local"):
                    raise ValueError(f"{type(module).__name__}.{name} is already wrapped or sharded: call "
                                     "apply_weight_gather once, before fully_shard")
                spec = GatherSpec(bits, block, hadamard, tuple(p.shape))
                done[id(p)] = nn.Parameter(QuantizedGatherWeight(p.data, spec), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]
    return len(done)


def quantize_shard(local: torch.Tensor, lay: WireLayout) -> torch.Tensor:
    """`quantize_shard_reference`, by the fused Triton kernel on CUDA tensors."""
    if local.is_cuda:
        from agoq.runtime.comm.weight_gather_triton import quantize_shard_triton

        return quantize_shard_triton(local, lay)
    return quantize_shard_reference(local, lay)


def dequantize_gather(gathered: torch.Tensor, lay: WireLayout, world: int, out: torch.Tensor) -> None:
    """`dequantize_gather_reference`, by the fused Triton kernel on CUDA tensors."""
    if gathered.is_cuda:
        from agoq.runtime.comm.weight_gather_triton import dequantize_gather_triton

        dequantize_gather_triton(gathered, lay, world, out)
    else:
        dequantize_gather_reference(gathered, lay, world, out)


__all__ = ["apply_weight_gather", "QuantizedGatherWeight", "GatherSpec", "gathered_weight", "unwrap",
           "DEFAULT_BLOCK"]
