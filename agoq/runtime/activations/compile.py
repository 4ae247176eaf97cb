"""torch.compile per decoder layer, as torchtitan compiles per block: each layer is its own compiled region.

Every agoq kernel a layer runs is a torch operator (`agoq::rms_norm`, `agoq::swiglu`, `agoq::quantize_block`,
`agoq::dequantize_block` and their backwards) and LAAQ's autograd functions trace whole, so a layer under any
activation policy, recomputing or checkpointed, compiles to one graph. The operators are triton_ops
(agoq.triton_ops): on CUDA, Inductor traces their bodies and launches agoq's Triton kernels from its own code.
Apply the policy (and checkpointing) first or after: the compiled layer calls whatever `forward` the layer has, and
recompiles when it changes.

Modes (torch.compile's `mode`): "default"; "max-autotune-no-cudagraphs"; "reduce-overhead", which records each
compiled region as a CUDA graph and replays it, removing the per-kernel launch cost on the host. What CUDA graphs
require of the ops in a layer:
  * no host synchronisation while capturing (agoq's ops have none: LAAQ quantizes with check_finite=False, and
    the chunked loss counts its labels on the device; the loss itself stays outside the compiled layers);
  * no host-side state that must change between replays. Stochastic rounding breaks this: a quantize call with
    seed None draws its Philox seed from torch's CPU generator on the host, so the seed captured in the graph
    would be replayed unchanged every step (the same noise each step). `compile_decoder_layers` therefore refuses
    mode="reduce-overhead" for a model whose activation policy rounds stochastically.
  * static integers: a layer's bit widths (and every other setting) are plain ints in its forward's closure. All
    decoder layers share one forward code object, so one layer's widths differing from another's is, to Dynamo, an
    int that changed between calls, which it would turn into a symbolic int (automatic dynamic); agoq's Triton
    bodies need them as constants. `compile_decoder_layers` compiles with dynamic=False (one graph per distinct
    layer configuration) and lets Dynamo keep a graph for every layer (recompile_limit >= 2 x layers + 8: training
    and no-grad calls).
  * static shapes and stable input addresses: inputs are copied into the graph's buffers on replay, and outputs
    are overwritten by the next replay, so a training loop marks each step (`mark_cudagraph_step`).

A process whose layers' graphs come from Inductor's cache (a second run of the same model) can run its first
seconds of steps slower: on an H200 the probe's compiled bf16 step measured 155-184 ms for 40 steps after a 3 s
compile, where the run that filled the cache measured 107-111 ms after a 14 s compile, and other runs returned to
~110 ms after 13 to 31 steps (experiments/step_warmup.py, experiments/results/step_warmup.json). The host was idle
(load average below 1 on 16 cores), and starting Inductor's compile workers before the model was built, waiting for
every worker to answer before the first step, did not remove it. Step times are therefore judged on the steady
state (agoq.train.plan_check, experiments/plan_accuracy.py), and the profile measures each kind of step twice.
"""

from __future__ import annotations

import torch
from torch import nn

from agoq.runtime.activations.saved_bytes import find_decoder_layers
from agoq.vocabulary import CUDA_GRAPH_MODES, TORCH_COMPILE_MODES


def allow_cached_autograd_functions() -> None:
    """Let AOT autograd's cache keep graphs that hold LAAQ's autograd functions (a setting of the process).

    Dynamo traces each torch.autograd.Function into the layer's graph as one higher-order op carrying its forward
    and backward graphs, so the cache key covers both; torch still leaves such graphs out of its cache unless
    `torch._functorch.config.autograd_cache_allow_custom_autograd_functions` is set, and every compiled layer under
    LAAQ then runs AOT autograd again in each new process or model. With it set, a later model of the same layer
    graph loads it: on one H200 the probe's offloading step (agoq-paper's layers) took its first step in 1.91 s
    instead of 4.31, with the same losses (`experiments/results/compile_cache_probe_*.json`). The environment
    variable TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD, where set, still decides."""
    import torch._functorch.config as functorch

    if hasattr(functorch, "autograd_cache_allow_custom_autograd_functions"):
        functorch.autograd_cache_allow_custom_autograd_functions = True


def compile_decoder_layers(model: nn.Module, mode: str | None = None, **options) -> int:
    """Compile each decoder layer of `model` on its own (`nn.Module.compile(mode=mode, **options)`, e.g.
    backend="inductor"); the embedding, final norm and loss stay eager. `mode` is torch.compile's (None or
    "default": the default; see the module docstring for "reduce-overhead", which is refused with stochastic
    rounding). Returns the number of layers compiled."""
    if mode is not None and mode not in TORCH_COMPILE_MODES:
        raise ValueError(f"torch.compile mode must be one of {', '.join(TORCH_COMPILE_MODES)}, got {mode!r}")
    if mode in CUDA_GRAPH_MODES:  # both record CUDA graphs
        policy = getattr(model, "_agoq_policy", None)
        if policy is not None and getattr(policy, "rounding", "nearest") == "stochastic":
            raise ValueError(
                f"compile mode {mode!r} records CUDA graphs, which would freeze the host-drawn seeds of stochastic "
                "rounding (the same noise every step); use mode 'default' or 'max-autotune-no-cudagraphs', or "
                "nearest rounding")
    if mode is not None and mode != "default":
        options["mode"] = mode
    options.setdefault("dynamic", False)  # see "static integers" in the module docstring
    layers = find_decoder_layers(model)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * len(layers) + 8)
    allow_cached_autograd_functions()
    for layer in layers:
        layer.compile(**options)
    return len(layers)


def mark_cudagraph_step(mode: str | None) -> None:
    """Under CUDA graphs (mode "reduce-overhead" / "max-autotune"), tell torch a new training step begins, so that
    the previous step's graph outputs may be overwritten; nothing in other modes."""
    if mode in CUDA_GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()
