"""Keeping what decoder layers save for backward in host memory instead of on the GPU.

`apply_offload(model, layers=[...])` wraps the call of each chosen decoder layer (compiled or eager: the wrapper
sits outside torch.compile's region) in `torch.autograd.graph.saved_tensors_hooks`. Every tensor the layer's
autograd graph saves for backward (bf16 activations, or under LAAQ the packed 4-bit codes and their scales) is
copied, as it is saved, to pinned host memory on a copy stream of its own, and its GPU memory returns to the
allocator once the copy is done. In backward, when the gradient of a layer's output is complete (backward is about
to run that layer), a hook starts bringing back the tensors of the nearest offloaded layer below it on a second
copy stream, so the host-to-device copies run under the compute of the layer above. On a GPU it also starts the
offloaded layers below that, nearest first, as far as the memory backward has freed since it began allows
(`torch.cuda.memory_allocated` then against now): a layer whose copy takes longer than one layer's backward is
then on its way several layers early, and the device holds no more than at the start of backward plus the one
layer always fetched. Not while a checkpointed layer between is still to run its backward: its rerun forward needs
the memory freed above it, so until then only the nearest offloaded layer comes back. A layer whose tensors were
not on their way when backward asked for them fetches them then (`OffloadStats.fetched_on_demand`). The compute stream waits only for a copy that has not ended by the time its
tensor is used.

The copies out start when the layer's call returns, all of the layer's tensors together (one wait on the compute
stream, one event): a compiled layer saves its tensors at the end of its forward anyway, and the host work per
tensor is what limits a forward whose kernels are short.

What is not offloaded: parameters and buffers, tensors the layer was handed besides its hidden state (RoPE
tables, masks, shared by every layer), and tensors under `min_bytes` (not worth a copy).

Host memory is a pool of pinned chunks (`HostPool`, agoq.runtime.activations.host_memory): pinning is slow (milliseconds per call), so chunks are made
during the first micro-batch and reused, front to back, by every later one: the pool is emptied when the training
loop starts a micro-batch (`begin_micro_batch`), or when a forward begins after every tensor of the one before was
brought back. `host_budget_bytes` caps the
pool: a tensor that would pass it stays on the GPU (counted in `OffloadStats.kept_on_gpu_bytes`).

Strides are kept and dense tensors cross in one copy each way (agoq.runtime.activations.host_memory).

Byte counts: what a layer offloads per micro-batch is the sum of numel * element size of its saved tensors; each
crosses the host link twice (out in forward, back in backward).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from agoq.runtime.activations.host_memory import HostPool, OffloadStats, _dense, _fill, _Saved, _storage_ptr, _tensors
from agoq.runtime.activations.saved_bytes import find_decoder_layers

MIN_BYTES = 64 << 10  # smaller saved tensors stay on the GPU


class ActivationOffload:
    """The saved-tensor hooks of a model's offloaded layers, their host pool and their copy streams."""

    def __init__(self, model: nn.Module, *, min_bytes: int = MIN_BYTES, host_budget_bytes: int | None = None,
                 device: torch.device | None = None):
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        params = list(model.parameters()) + list(model.buffers())
        if device is None:
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.cuda else None
        self.min_bytes = min_bytes
        self.pool = HostPool(pin=self.cuda, budget_bytes=host_budget_bytes)
        self._model_storages = {_storage_ptr(t) for t in params}
        self.stats = OffloadStats()
        self._entries: list[_Saved] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor, _Saved]] = []  # (tensor, source, entry) to copy out
        self._layer_order: list[int] = []  # layers in the order their first tensor was offloaded
        self._layer_bytes: dict[int, int] = {}  # offloaded bytes per layer this micro-batch
        self._by_layer: dict[int, list[_Saved]] = {}  # this micro-batch's entries per layer
        self._fetched: set[int] = set()  # layers whose copies back have started
        self._waited: set[int] = set()  # ids of the copy-back events the compute stream waits for already
        self._waited_events: list = []
        self._compiled_plain: set[int] = set()  # layers compiled once without the hooks (see wrap)
        self._backward_base: int | None = None  # bytes allocated when this micro-batch's backward began
        self.checkpointed: set[int] = set()  # decoder layers that rerun their forward in backward (apply_offload)
        self._live = 0  # offloaded tensors not yet brought back in backward
        self._skip: set[int] = set()  # storages never offloaded: parameters, buffers, the current call's extras
        self._d2h = self._h2d = None
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)

    # -------------------------------------------------------------- micro-batches

    def begin_micro_batch(self) -> None:
        """A training micro-batch begins, so the last one's backward has ended: its offloaded tensors, those
        backward never asked for included (autograd may save a tensor it does not use), are let go and the pool
        is emptied. Not for a pipeline, whose micro-batches overlap."""
        if self._entries:
            self._restart()

    def _restart(self) -> None:
        if self.cuda:  # copies back from the pool must end before the next forward writes over it
            self._d2h.wait_stream(self._h2d)
        self._flush()
        self.stats.never_unpacked += self._live
        self.pool.reset()
        self._entries, self._layer_order, self._live = [], [], 0
        self._layer_bytes, self._backward_base, self._by_layer, self._fetched = {}, None, {}, set()
        self._waited, self._waited_events = set(), []
        self.stats.micro_batches += 1
        self.stats.bytes_per_layer = {}

    # -------------------------------------------------------------- hooks

    def _eligible(self, t: torch.Tensor) -> bool:
        return (t.device == self.device and t.numel() * t.element_size() >= self.min_bytes
                and not t.is_sparse and _storage_ptr(t) not in self._skip)

    def pack(self, layer: int, t: torch.Tensor):
        if not self._eligible(t):
            return t
        if self._live == 0 and self._entries:  # a forward after the last backward ended, without begin_micro_batch
            self._restart()
        nbytes = t.numel() * t.element_size()
        raw = self.pool.take(nbytes)
        if raw is None:
            self.stats.kept_on_gpu_bytes += nbytes
            return t
        dense = _dense(t)
        host = raw.view(t.dtype)  # numel elements, contiguous
        entry = _Saved(host, t.size(), t.stride(), dense, t.device, layer)
        # a dense tensor is copied as the numel elements its storage holds from its offset on (one memcpy whatever
        # its strides); any other is made contiguous first, on the copy stream
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset()) if dense else None
        if self.cuda:  # copied out with the rest of the layer's tensors when its call returns (_flush)
            self._pending.append((t, flat, entry))
        else:
            host.copy_(flat if dense else t.reshape(-1))
        if layer not in self._layer_order:
            self._layer_order.append(layer)
        self._layer_bytes[layer] = self._layer_bytes.get(layer, 0) + nbytes
        self._by_layer.setdefault(layer, []).append(entry)
        self._entries.append(entry)
        self._live += 1
        self.stats.offloaded_bytes += nbytes
        self.stats.offloaded_tensors += 1
        self.stats.bytes_per_layer[layer] = self.stats.bytes_per_layer.get(layer, 0) + nbytes
        return len(self._entries) - 1

    def _flush(self) -> None:
        """Start copying out the tensors packed since the last flush: one wait on the compute stream, one call that
        issues every copy (`torch._foreach_copy_`: the per-tensor work in C++, not Python), one event."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._d2h.wait_stream(torch.cuda.current_stream(self._index))
        copied = torch.cuda.Event()
        with torch.cuda.stream(self._d2h):
            torch._foreach_copy_([e.host for _t, _f, e in pending],
                                 [f if f is not None else t.contiguous().view(-1) for t, f, _e in pending],
                                 non_blocking=True)
            copied.record(self._d2h)
        for t, _flat, entry in pending:
            entry.copied = copied
            t.record_stream(self._d2h)  # its memory is reused only after the copy

    def unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        self._flush()  # asked for within the call that saved it
        entry = self._entries[handle]
        if entry.unpacked:  # asked again (a graph kept for a second backward): from the host copy, now
            if self.cuda:
                torch.cuda.current_stream(self._index).wait_event(entry.copied)
            return self._rebuilt(entry)
        if entry.gpu is None:  # not prefetched (the layer below is started by this layer's output hook)
            self.stats.fetched_on_demand += 1
            self._fetch(entry.layer)
        out = entry.gpu
        if self.cuda and id(entry.ready) not in self._waited:  # once per layer: its tensors share the event
            torch.cuda.current_stream(self._index).wait_event(entry.ready)
            self._waited.add(id(entry.ready))
            self._waited_events.append(entry.ready)  # kept alive, so that its id is not reused this micro-batch
        entry.gpu = entry.ready = None  # autograd holds it now
        entry.unpacked = True
        self._live -= 1
        return out

    def _fetch(self, layer: int) -> None:
        """Start bringing back every tensor of `layer` not already on its way: one call issues the copies."""
        self._fetched.add(layer)
        todo = [e for e in self._by_layer.get(layer, ()) if e.gpu is None and not e.unpacked]
        if not todo:
            return
        if not self.cuda:
            for e in todo:
                e.gpu = self._rebuilt(e)
            return
        compute = torch.cuda.current_stream(self._index)
        buffers = [torch.empty_strided(e.size, e.stride, dtype=e.host.dtype, device=e.device) for e in todo]
        self._h2d.wait_stream(compute)  # their memory is free on the compute stream from here on
        with torch.cuda.stream(self._h2d):
            for event in {id(e.copied): e.copied for e in todo}.values():  # the layer's tensors share one event
                self._h2d.wait_event(event)
            dense = [(e, gpu) for e, gpu in zip(todo, buffers) if e.dense]
            if dense:
                torch._foreach_copy_([gpu.as_strided((gpu.numel(),), (1,), 0) for _e, gpu in dense],
                                     [e.host for e, _gpu in dense], non_blocking=True)
            for e, gpu in zip(todo, buffers):
                if not e.dense:
                    _fill(gpu, e, non_blocking=True)
                gpu.record_stream(self._h2d)
            ready = torch.cuda.Event()  # one for the layer: backward uses its tensors together
            ready.record(self._h2d)
        for e, gpu in zip(todo, buffers):
            e.gpu, e.ready = gpu, ready

    @staticmethod
    def _rebuilt(e: _Saved) -> torch.Tensor:
        """`e` on its device again, copied on the current stream."""
        return _fill(torch.empty_strided(e.size, e.stride, dtype=e.host.dtype, device=e.device), e)

    # -------------------------------------------------------------- layers

    def prefetch_below(self, index: int) -> None:
        """Backward is about to run layer `index`: start bringing back the nearest offloaded layer below it, which
        backward needs next (called by a hook on layer `index`'s output, whose gradient is complete just then), and
        on a GPU the ones below that as far as the memory freed since backward began allows (module docstring)."""
        below = sorted((i for i in self._layer_order if i < index), reverse=True)
        if not below:
            return
        if below[0] not in self._fetched:
            self._fetch(below[0])
        if not self.cuda:
            return
        # the allocator's counters as they are (memory_allocated flattens every statistic into a new dict first)
        now = torch.cuda.memory_stats_as_nested_dict(self._index)["allocated_bytes"]["all"]["current"]
        if self._backward_base is None:
            self._backward_base = now
        for layer in self.ahead(index, self._backward_base - now):  # what backward has freed (fetched buffers
            self._fetch(layer)                                         # already count in `now`)
            self.stats.fetched_ahead += 1

    def ahead(self, index: int, room: int) -> list[int]:
        """The offloaded layers below the nearest one under layer `index` to start bringing back now, nearest first,
        within `room` bytes (what backward has freed since it began). None while a checkpointed layer from `index`
        down to the nearest offloaded one is still to run its backward: its rerun forward allocates on top of what
        the step holds, so the memory freed above it is not free for copies (the search prices a checkpointed
        layer's backward with one offloaded layer fetched, agoq.search.problem)."""
        below = sorted((i for i in self._layer_order if i < index), reverse=True)
        if len(below) < 2 or any(below[0] <= j <= index for j in self.checkpointed):
            return []
        out = []
        for layer in below[1:]:
            if layer in self._fetched:
                continue  # on its way already
            need = self._layer_bytes.get(layer, 0)
            if need > room:
                break
            out.append(layer)
            room -= need
        return out

    def wrap(self, index: int, call, offloaded: bool = True, compiled: bool = False):
        """`call` (a layer's call) with its saved tensors offloaded under layer index `index` (`offloaded` False:
        kept, the wrapper only starts bringing back the offloaded layer below when backward reaches this one;
        `compiled`: `call` is torch.compile's, whose first call compiles)."""

        def signal(output):
            first = output if isinstance(output, torch.Tensor) else next(iter(_tensors(output)), None)
            if first is not None and first.requires_grad:
                first.register_hook(lambda grad: self.prefetch_below(index))
            return output

        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            if not offloaded:
                return signal(call(*args, **kwargs))
            extras = list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
            self._skip = self._model_storages | {_storage_ptr(t) for t in _tensors(extras)}
            if compiled and index not in self._compiled_plain and torch.is_grad_enabled():
                # torch.compile traces a layer at its first call, and a torch.func transform in its backward
                # (LAAQ's quantized attention reruns its forward by torch.func.vjp) refuses to be traced while a
                # saved-tensor hook is registered: the first call compiles the layer without the hooks, its output
                # let go at once (one layer's activations, for a moment), and the hooks apply from then on
                self._compiled_plain.add(index)
                call(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self.pack, index), self.unpack):
                output = call(*args, **kwargs)
            if self.cuda:
                self._flush()
            return signal(output)

        wrapped._agoq_offload = self
        return wrapped


def apply_offload(model: nn.Module, *, layers, min_bytes: int = MIN_BYTES, host_budget_bytes: int | None = None,
                  device: torch.device | None = None) -> ActivationOffload | None:
    """Offload the saved tensors of decoder layers `layers` (indices; empty: none, returns None). Apply it after
    torch.compile (it wraps the compiled call) and after checkpointing (it reads which layers rerun their forward).
    Replaces an offload applied before."""
    remove_offload(model)
    layers = sorted(set(int(i) for i in layers))
    if not layers:
        return None
    decoder = find_decoder_layers(model)
    bad = [i for i in layers if not 0 <= i < len(decoder)]
    if bad:
        raise ValueError(f"offload layers {bad} are out of range: the model has {len(decoder)} decoder layers "
                         f"(0-{len(decoder) - 1})")
    offload = ActivationOffload(model, min_bytes=min_bytes, host_budget_bytes=host_budget_bytes, device=device)
    offload.checkpointed = {i for i, layer in enumerate(decoder) if getattr(layer, "_agoq_checkpointed", False)}
    for i in range(layers[0], len(decoder)):  # the layers above the first offloaded one start its prefetches
        layer = decoder[i]
        call = layer._compiled_call_impl or layer._call_impl
        layer._agoq_uncompiled_call = layer._compiled_call_impl
        layer._compiled_call_impl = offload.wrap(i, call, offloaded=i in layers,
                                                 compiled=layer._agoq_uncompiled_call is not None)
    model._agoq_offload = offload
    return offload


def remove_offload(model: nn.Module) -> None:
    """Undo `apply_offload` (the layers' calls as they were)."""
    for layer in find_decoder_layers(model):
        if hasattr(layer, "_agoq_uncompiled_call"):
            layer._compiled_call_impl = layer._agoq_uncompiled_call
            del layer._agoq_uncompiled_call
    if hasattr(model, "_agoq_offload"):
        del model._agoq_offload


def parse_offload_layers(text: str | None, num_layers: int) -> list[int]:
    """The layers `--offload` names: "none", "all", "all-but-last" (every layer but the last: backward needs the
    last one's tensors at once, so its copy could not be hidden), or comma-separated indices and ranges ("0-5,8")."""
    if text is None or text.strip() in ("", "none"):
        return []
    text = text.strip()
    if text == "all":
        return list(range(num_layers))
    if text == "all-but-last":
        return list(range(num_layers - 1))
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError
                out += range(a, b + 1)
            else:
                out.append(int(part))
        except ValueError:
            raise ValueError(f"--offload {text!r}: {part!r} is no layer index or range; give none, all, "
                             "all-but-last, or indices and ranges like 0-5,8") from None
    bad = sorted({i for i in out if not 0 <= i < num_layers})
    if bad:
        named = f"{bad[0]}-{bad[-1]}" if len(bad) > 3 else ", ".join(map(str, bad))
        raise ValueError(f"--offload {text!r}: layer(s) {named} are out of range (the model has {num_layers} "
                         f"decoder layers, 0-{num_layers - 1})")
    return sorted(set(out))


__all__ = ["apply_offload", "remove_offload", "ActivationOffload", "HostPool", "OffloadStats",
           "parse_offload_layers", "MIN_BYTES"]
