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

Inductor's compile workers: the first compilation in a process starts Inductor's pool of compile worker processes,
which takes seconds of the host. When the layers' graphs come from Inductor's cache (a second run of the same
model), compiling ends long before the pool is up, and the first steps run while it starts: on an H200 the probe's
compiled bf16 step measured ~157 ms for ~30 steps (about 8 s after compiling began), then 110 ms, where a run with
the pool started beforehand, or with no pool, measured 107-110 ms from its second step
(experiments/step_warmup.py). `start_compile_workers` starts the pool early (before the model is built) and
`wait_for_compile_workers` waits, before the first step, until every worker has answered.
"""

from __future__ import annotations

import torch
from torch import nn

from agoq.activations.saved_bytes import find_decoder_layers

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


def compile_decoder_layers(model: nn.Module, mode: str | None = None, **options) -> int:
    """Compile each decoder layer of `model` on its own (`nn.Module.compile(mode=mode, **options)`, e.g.
    backend="inductor"); the embedding, final norm and loss stay eager. `mode` is torch.compile's (None or
    "default": the default; see the module docstring for "reduce-overhead", which is refused with stochastic
    rounding). Returns the number of layers compiled."""
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode in ("reduce-overhead", "max-autotune"):  # both record CUDA graphs
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
    for layer in layers:
        layer.compile(**options)
    return len(layers)


def _pool():
    """Inductor's compile worker pool, or None where Inductor compiles in this process (one compile thread, a
    daemonic process) or this torch has no such pool."""
    try:
        from torch._inductor.async_compile import AsyncCompile, _process_pool_allowed, get_compile_threads
    except ImportError:
        return None
    if get_compile_threads() <= 1 or not _process_pool_allowed():
        return None
    return AsyncCompile


def start_compile_workers() -> None:
    """Start Inductor's compile worker pool now, so that it is up before the steps run (the module docstring)."""
    pool = _pool()
    if pool is not None:
        pool.warm_pool()
        pool.use_process_pool()  # its first job: the workers start


def _pause(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds


def _pause_pid(seconds: float) -> int:
    """`_pause`, returning the worker's process id (tests)."""
    import os

    _pause(seconds)
    return os.getpid()


def wait_for_compile_workers(timeout: float = 120.0, pause: float = 0.05) -> None:
    """Wait until Inductor's compile workers have started: the pool's first job has run, then one job per worker
    that holds its worker `pause` seconds, so that they spread over every worker (at most `timeout` seconds)."""
    pool = _pool()
    if pool is None:
        return
    pool.wait_pool_ready(timeout)
    from torch._inductor.async_compile import get_compile_threads

    jobs = [pool.process_pool().submit(_pause, pause) for _ in range(get_compile_threads())]
    for job in jobs:
        job.result(timeout=timeout)


def mark_cudagraph_step(mode: str | None) -> None:
    """Under CUDA graphs (mode "reduce-overhead" / "max-autotune"), tell torch a new training step begins, so that
    the previous step's graph outputs may be overwritten; nothing in other modes."""
    if mode in ("reduce-overhead", "max-autotune"):
        torch.compiler.cudagraph_mark_step_begin()
