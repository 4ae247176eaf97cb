"""What a step costs under torch.compile, from the profile's `compiled` section: the time of layers running LAAQ's
functions, the fwd + bwd seconds at another micro-batch, and the peak calibration of compiled steps.

Time. The profile's per-kind extra seconds are eager kernel times (a quantize, a dequantize, a recompute launched
on their own). Inside a compiled decoder layer they do not hold: agoq's operators run in the compiled graph, the
quantize sits in the epilogue of the kernel that produces its input and the recomputed norm or SwiGLU is fused with
its consumer, so the compiled agoq-paper step costs a small fraction of the recipe's eager extras over compiled bf16.
What the compiled section measures is one difference, the compiled agoq-paper step against the compiled bf16 step,
both at the profiled micro-batch m0 (one micro-batch per step). The compiled model spreads it over the layers:

    delta = (compiled agoq-paper step - compiled bf16 step) / L          seconds per LAAQ layer per micro-batch
    step  = grad_accum x fb(m) + optimizer step
            + grad_accum x delta x (layers running LAAQ's functions)
            + grad_accum x fb(m) / fb(m0) x (forward seconds of the checkpointed layers at m0)

and the options of a LAAQ layer add no seconds of their own (which widths and recomputes it chooses is a matter
of memory and error). delta is charged per micro-batch, not per token: it is the layer's operator overhead,
which a smaller micro-batch does not shrink. A checkpointed layer reruns its compiled forward:
(compiled checkpoint-all step - compiled bf16 step) / L at m0, scaled with fb.

fb(m), the fwd + bwd seconds of one micro-batch of m sequences, is measured at m0 (bf16 step - its optimizer
step) and at each smaller micro-batch the section's `micro_batch_steps` hold; between and beyond the measured
sizes it is the least-squares line a + b x m through them (a: the per-micro-batch overhead). With m0 alone the
line goes through the origin (fb(m) = fb(m0) x m / m0: no overhead known), and the search is told so.

Peak. The compiled section's steps (bf16, agoq-paper, checkpoint-all at m0, the profile's optimizer, bf16
gradients) are predicted with the memory model as any plan is; where a measured peak exceeds its prediction, the
largest excess (bytes) is added to every compiled plan's peak as a calibration margin, so that no compiled plan is
predicted below what the model under-predicted on a measured one. (The partitioner saves less than the eager
model counts for unmodified layers, so these predictions are usually upper bounds and the margin is 0.)
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def forward_backward_seconds(points: dict, micro_batch: int) -> float:
    """fb(micro_batch), seconds of one fwd + bwd of `micro_batch` sequences, from measured {micro_batch: seconds}
    (see the module docstring): the measured value, else the least-squares line a + b x m (through the origin
    when one size is measured)."""
    if not points:
        raise ValueError("no measured fwd + bwd seconds to scale from")
    if micro_batch in points:
        return float(points[micro_batch])
    m = np.array(sorted(points), dtype=float)
    t = np.array([points[int(k)] for k in m], dtype=float)
    if len(m) == 1:
        return float(t[0] * micro_batch / m[0])
    b, a = np.polyfit(m, t, 1)
    return float(a + b * micro_batch)


def compiled_layer_seconds(timing: dict, num_layers: int) -> Optional[float]:
    """delta of the module docstring (seconds per LAAQ layer per micro-batch), None without both compiled steps."""
    if timing.get("paper") is None or timing.get("bf16") is None:
        return None
    return (timing["paper"] - timing["bf16"]) / num_layers


def compiled_peak_margin(profile, predict) -> tuple[float, list]:
    """The calibration margin of the module docstring: max(0, measured - predicted) bytes over the compiled
    section's steps that have a measured peak. `predict(policy)` gives the model's peak (bytes) of one compiled
    step ("bf16", "agoq-paper" or "checkpoint-all") at the profiled knobs, or None where it cannot. Returns
    (margin, [(policy, measured, predicted), ...])."""
    section = profile.header.get("compiled") or {}
    rows = []
    for step in section.get("steps") or []:
        measured = step.get("peak_bytes")
        if measured is None:
            continue
        predicted = predict(str(step.get("policy")))
        if predicted is not None:
            rows.append((str(step["policy"]), float(measured), float(predicted)))
    margin = max([0.0] + [m - p for _, m, p in rows])
    return margin, rows


__all__ = ["forward_backward_seconds", "compiled_layer_seconds", "compiled_peak_margin"]
