"""Step times and peaks under torch.compile: the profile's optional "compiled" section (docs/formats.md).

Each decoder layer is compiled on its own (agoq.activations.compile, mode "default"); the step is the profiler's
measured step (agoq.profiler.memory: fwd + bwd, then the fused 8-bit AdamW with float32 masters). Steps:

  bf16            the model as it is
  agoq-paper      the published recipe (its layers compile whole: agoq's kernels are torch operators)
  checkpoint-all  every decoder layer checkpointed
  memory budget B bf16 with torch._functorch.config.activation_memory_budget = B (the partitioner recomputes
                  to keep about B of the activations): `memory_budget_points`
  micro-batch m   bf16 on the first m sequences, for each m < the profiled micro-batch that divides it:
                  `micro_batch_steps` (how much slower each token runs at a smaller micro-batch)

For each: the median step seconds of `steps` timed steps after `warmup` untimed ones (the first compiles), its
optimizer step's seconds, and on a GPU the peak bytes of the fwd + bwd part and of the optimizer step
(torch.cuda.max_memory_allocated, after warm-up). The search prices compiled plans and compiled alternatives
from these (agoq.search.costs.mode_timing, agoq.search.alternatives).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch import nn

from agoq.activations.checkpointing import apply_checkpointing, remove_checkpointing
from agoq.activations.compile import compile_decoder_layers
from agoq.activations.laaq import apply_activation_policy, remove_activation_policy
from agoq.activations.saved_bytes import find_decoder_layers
from agoq.optim.adamw8bit import FusedAdamW8bit
from agoq.profiler.memory import training_loss

MEMORY_BUDGETS = (0.5, 0.1)


def _reset(model: nn.Module) -> None:
    remove_activation_policy(model)
    remove_checkpointing(model)
    for layer in find_decoder_layers(model):
        layer._compiled_call_impl = None
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = 1.0


def compiled_step(model: nn.Module, ids: torch.Tensor, *, policy=None, checkpoint: bool = False,
                  memory_budget: float | None = None, warmup: int = 2, steps: int = 3) -> dict:
    """One variant (see the module docstring) measured compiled: step_seconds, optimizer_step_seconds,
    peak_bytes_forward_backward, peak_bytes_optimizer_step and peak_bytes (None off the GPU)."""
    device = ids.device
    cuda = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = FusedAdamW8bit(params, lr=0.0, masters=True)  # lr 0: the weights do not move between variants
    # Dynamo's graphs are cached per code object and guarded on the inputs, not on functorch's memory budget: a
    # graph another model compiled earlier in this process (same layer code, same shapes) would be reused with its
    # own partition, whatever budget is set now
    torch._dynamo.reset()
    try:
        if policy is not None:
            apply_activation_policy(model, policy)
        if checkpoint:
            apply_checkpointing(model)
        if memory_budget is not None:
            torch._functorch.config.activation_memory_budget = float(memory_budget)
        compile_decoder_layers(model)
        times, opt_times, fb_peaks, opt_peaks = [], [], [], []
        for i in range(warmup + steps):
            for p in params:
                p.grad = None
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            training_loss(model, ids).backward()
            if cuda:
                torch.cuda.synchronize(device)
                fb = torch.cuda.max_memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            t1 = time.perf_counter()
            opt.step()
            if cuda:
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            if i >= warmup:
                times.append(t2 - t0)
                opt_times.append(t2 - t1)
                if cuda:
                    fb_peaks.append(fb)
                    opt_peaks.append(torch.cuda.max_memory_allocated(device))
    finally:
        for p in params:
            p.grad = None
        del opt
        _reset(model)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    out = {"step_seconds": statistics.median(times), "optimizer_step_seconds": statistics.median(opt_times),
           "peak_bytes_forward_backward": max(fb_peaks) if fb_peaks else None,
           "peak_bytes_optimizer_step": max(opt_peaks) if opt_peaks else None}
    out["peak_bytes"] = max(out["peak_bytes_forward_backward"], out["peak_bytes_optimizer_step"]) if fb_peaks else None
    return out


def compiled_section(model: nn.Module, ids: torch.Tensor, memory_budgets=MEMORY_BUDGETS, failures: list | None = None,
                     warmup: int = 2, steps: int = 3) -> dict:
    """The profile's "compiled" section: steps (bf16, agoq-paper, checkpoint-all), memory_budget_points and
    micro_batch_steps (bf16 at each smaller micro-batch dividing ids' batch); a
    variant that fails (out of memory, a compiler error) is listed in `failures` and left out."""
    section: dict = {"mode": "default", "per": "decoder layer", "steps": [], "memory_budget_points": []}
    variants = [("bf16", dict()), ("agoq-paper", dict(policy="agoq-paper")), ("checkpoint-all", dict(checkpoint=True))]
    variants += [(f"memory budget {b:g}", dict(memory_budget=b)) for b in memory_budgets]
    profiled = ids.shape[0]
    variants += [(f"micro-batch {m}", dict(micro_batch=m)) for m in range(1, profiled) if profiled % m == 0]
    for name, kwargs in variants:
        micro_batch = kwargs.pop("micro_batch", None)
        try:
            m = compiled_step(model, ids if micro_batch is None else ids[:micro_batch], warmup=warmup, steps=steps,
                              **kwargs)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            if failures is not None:
                failures.append({"what": f"compiled step {name}", "error": f"{type(e).__name__}: {e}"[:500]})
            continue
        if micro_batch is not None:
            section.setdefault("micro_batch_steps", []).append({"policy": "bf16", "micro_batch": micro_batch, **m})
        elif "memory_budget" in kwargs:
            section["memory_budget_points"].append({"activation_memory_budget": kwargs["memory_budget"], **m})
        else:
            section["steps"].append({"policy": name, **m})
    return section


__all__ = ["compiled_section", "compiled_step", "MEMORY_BUDGETS"]
