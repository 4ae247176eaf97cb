"""Sensitivity by replaying backward: one forward per batch, then one partial backward per option.

Keeping a tensor at b bits changes nothing in the forward pass (LAAQ's forward values do not depend
on the policy) and, in backward, only what uses that tensor: the gradients above layer L are those
of the reference, and below they change only through what layer L's backward computes from the
dequantized tensor. So one reference forward is kept (retain_graph) with saved-tensor hooks that tag
every tensor LAAQ keeps raw with its (layer, kind); the reference gradient dy_L at each layer's
output is taken once, and for each option the backward from layer L's output (with dy_L) is run
again while the hook hands backward dequantize(quantize(x)) in place of the tagged tensors, exactly
what LAAQ would have restored. Layers above L and the LM head are not recomputed at all.

    error = ||g_option - g_ref|| / ||g_ref||,  with g_option - g_ref = partial_option - partial_ref

partial_* being the gradients of all parameters from layer L's output down (the same computation for
both, so rounding in the untouched part cancels exactly), and ||g_ref|| the full reference gradient.
For the kinds in LOCAL_KINDS (kept only as a projection's input, read in backward only by that
projection's weight gradient) every gradient below layer L is the reference's, so partial_* is taken
over layer L's own parameters only: one layer's backward per option instead of those of layers L..0
(the same number up to the floating-point noise of the lower layers: none where backward is
deterministic).
This applies to quantized options of the kinds LAAQ keeps raw at 16 bits. Attention at 16 bits is
torch's fused attention, which keeps its own tensors, so a session built with `attention=True` runs its
reference forward under laaq.rerun_kept_attention: every layer keeps q, k, v raw in LAAQ's attention
function, whose backward reruns attention from them (torch.func.vjp) -- the same function and values a
b-bit option runs in layer L, and for the 16-bit layers the same values as the fused attention's own
backward (one forward, one backward of the same kernel on the same inputs). Substituting
dequantize(quantize(x)) for each of q, k and v (same bits, block, rounding and format) is then exactly what
the option's policy restores. Attention is not local: dq, dk, dv flow to the layers below. Because that
session reruns attention in every layer's backward, the profiler builds it only for the attention
measurements (agoq.profiler.sensitivity.measure_chunk). Recompute options are not replayed
(`SensitivityMeter`). tests/profiler/test_replay.py checks replay and policy runs give the same numbers.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from agoq.runtime.activations.laaq import (
    apply_activation_policy,
    observe_kept_tensors,
    remove_activation_policy,
    rerun_kept_attention,
)
from agoq.runtime.activations.policy import KEEP, ActivationPolicy
from agoq.runtime.activations.saved_bytes import find_decoder_layers
from agoq.profiler.model_source import next_token_loss
from agoq.runtime.quant.codec import dequantize, quantize

REPLAYABLE = ("norm_input", "qkv_input", "o_proj_input", "ffn1_input", "silu_input", "ffn2_input", "attention")
"""The kinds whose quantized options are replayed; "attention" only by a session built with attention=True."""

LOCAL_KINDS = frozenset({"qkv_input", "o_proj_input", "ffn1_input", "ffn2_input"})
"""The replayable kinds whose error cannot leave their layer.

Each is kept only as the input x of projections y = x W^T + b (qkv_input: the attention norm's output,
input of q, k, v; o_proj_input; ffn1_input: the MLP norm's output, input of gate and up; ffn2_input:
silu(gate) * up, input of down). LAAQ's backward (agoq/runtime/activations/laaq.py: _NormLinears,
_StoredLinear, _SwiGLUDown) reads that tensor only for dW = dy^T x; the gradient sent down,
dx = dy W (and through the norm, RMSNorm's backward of the norm *input* with that dx), never reads it.
So substituting dequantize(quantize(x)) changes layer L's weight gradients dW and nothing else: every
gradient below layer L is the reference's bit for bit. Not local: norm_input (RMSNorm's backward reads
its input to form the input gradient) and silu_input (SiLU's derivative at gate, and up, form the
gradients of gate and up, which flow down through the projections and the norm).
"""


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class ReplaySession:
    """One reference forward of one batch, kept for replaying backward with one tensor kind substituted.

    `attention`: run the forward under laaq.rerun_kept_attention so that attention can be replayed too
    (every layer's backward then reruns attention: slower for the other kinds, same numbers)."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, reference: ActivationPolicy, attention: bool = False):
        self.model, self.attention = model, attention
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.block = reference.block
        self._target: tuple | None = None  # (layer, kind, bits, format) being substituted
        layers = find_decoder_layers(model)
        stack: list[int] = []
        outputs: list[torch.Tensor | None] = [None] * len(layers)
        tags: dict[tuple, tuple[int, str]] = {}
        self.tagged: set[tuple[int, str]] = set()  # (layer, kind) whose kept tensors were found
        self._substituted = 0
        handles = []

        def enter(index: int):
            def hook(module, args) -> None:
                stack.append(index)
            return hook

        def leave(index: int):
            def hook(module, args, output) -> None:
                stack.pop()
                outputs[index] = output[0] if isinstance(output, tuple) else output
            return hook

        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(enter(i)))
            handles.append(layer.register_forward_hook(leave(i)))

        def observe(kind: str, t: torch.Tensor, setting) -> None:
            if stack and setting == KEEP:
                tags[_key(t)] = (stack[-1], kind)

        def pack(t: torch.Tensor):
            try:
                tag = tags.pop(_key(t), None)
            except (RuntimeError, NotImplementedError):  # tensors without storage are never tagged
                tag = None
            if tag is not None:
                self.tagged.add(tag)
            # detached: a saved output (log_softmax's, say) would otherwise hold its own grad_fn through
            # this tuple, a cycle through C++ that no garbage collection frees
            return tag, t.detach()

        def unpack(packed):
            tag, t = packed
            target = self._target
            if tag is None or target is None or tag != target[:2]:
                return t
            self._substituted += 1
            q = quantize(t, target[2], self.block, "nearest", target[3], check_finite=False)
            return dequantize(q)

        apply_activation_policy(model, reference)
        try:
            rerun = rerun_kept_attention() if attention else contextlib.nullcontext()
            with rerun, observe_kept_tensors(observe), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = next_token_loss(model, ids)
        finally:
            remove_activation_policy(model)  # the recorded graph keeps its own functions
            for h in handles:
                h.remove()
        if any(o is None for o in outputs):
            raise RuntimeError("a decoder layer produced no output tensor to replay from")
        if tags:  # a tensor LAAQ was about to keep never reached autograd's saved tensors as itself
            raise RuntimeError(f"replay could not find {len(tags)} kept tensor(s) among the saved ones")
        self.outputs = outputs
        grads = torch.autograd.grad(loss, self.params + outputs, retain_graph=True, allow_unused=True)
        self.ref_grads = list(grads[: len(self.params)])
        self.dy = list(grads[len(self.params):])
        self.ref_norm2 = sum(g.float().pow(2).sum().item() for g in self.ref_grads if g is not None)
        self._layer_params = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
        # the reference partial of one layer per scope (False: from layer L down; True: layer L's own)
        self._partial_ref: dict[bool, tuple[int, list]] = {}

    def _partial(self, layer: int, local: bool = False) -> list:
        """Gradients with dy_L at layer `layer`'s output: of all parameters, or (`local`) of that layer's own."""
        params = self._layer_params[layer] if local else self.params
        return list(torch.autograd.grad(self.outputs[layer], params, self.dy[layer], retain_graph=True,
                                        allow_unused=True))

    def _reference(self, layer: int, local: bool) -> list:
        cached = self._partial_ref.get(local)
        if cached is None or cached[0] != layer:
            target, self._target = self._target, None
            try:
                cached = self._partial_ref[local] = (layer, self._partial(layer, local))
            finally:
                self._target = target
        return cached[1]

    def noise_floor(self, layer: int, local: bool = False) -> float:
        """The error of replaying layer `layer` (its own parameters only if `local`, as `error` does for
        LOCAL_KINDS) with nothing substituted: 0 where backward is deterministic; any other value is the
        run-to-run noise in every sensitivity replayed that way."""
        ref = self._reference(layer, local)
        return self._relative(self._partial(layer, local), ref)

    def _relative(self, got: list, ref: list) -> float:
        """||got - ref|| / ||g_ref|| over the gradients (None: not reached, taken as 0): each difference in float32
        (exact for bf16 inputs' differences up to float32 rounding), its norm by one multi-tensor kernel, squared and
        summed in float64. A replay from the top layer down has about 150 gradients: per-gradient reductions cost as
        many kernel launches as the replay's own backward."""
        diffs = []
        for g, r in zip(got, ref):
            if g is None and r is None:
                continue
            if g is None or r is None:
                diffs.append((r if g is None else g).float())
            else:
                d = g.float()
                diffs.append(d.sub_(r) if d is not g else d - r)  # never in place on a gradient autograd returned
        if not diffs or self.ref_norm2 <= 0:
            return 0.0
        diff2 = torch.stack(torch._foreach_norm(diffs)).double().pow(2).sum()
        return (diff2.item() / self.ref_norm2) ** 0.5

    def replay(self, layer: int, kind: str, bits: int, fmt: str, local: bool | None = None) -> tuple[list, list]:
        """(gradients with (layer, kind) kept at `bits` (`fmt`), the reference's), over layer `layer`'s own
        parameters if `local` (default: whether `kind` is in LOCAL_KINDS), else over all parameters
        (`self.params`; None for those the partial backward does not reach)."""
        if kind not in REPLAYABLE:
            raise ValueError(f"{kind} cannot be replayed; measure it with its policy")
        if kind == "attention" and not self.attention:
            raise ValueError("attention is replayed only by a ReplaySession built with attention=True")
        if (layer, kind) not in self.tagged:
            raise RuntimeError(f"replay found no kept tensor of layer {layer} kind {kind}")
        local = kind in LOCAL_KINDS if local is None else local
        ref = self._reference(layer, local)
        self._target = (layer, kind, bits, fmt if bits == 4 else "int")
        self._substituted = 0
        try:
            got = self._partial(layer, local)
        finally:
            self._target = None
        if self._substituted == 0:
            raise RuntimeError(f"replay of layer {layer} kind {kind}: backward never read the kept tensor")
        return got, ref

    def error(self, layer: int, kind: str, bits: int, fmt: str, _full: bool = False) -> float:
        """Relative L2 error of all weight gradients when only (layer, kind) is kept at `bits` (`fmt`).
        `_full`: replay from layer L down even for LOCAL_KINDS (the same number; for tests)."""
        got, ref = self.replay(layer, kind, bits, fmt, local=False if _full else None)
        return self._relative(got, ref)

    def close(self) -> None:
        """Free the kept graph."""
        self.outputs, self.dy, self.ref_grads, self._partial_ref = [], [], [], {}
