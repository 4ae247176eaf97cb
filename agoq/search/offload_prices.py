"""What keeping layers' saved tensors in pinned host memory costs a step, from the profile's measured host link and
offloading steps (agoq.search.problem.OffloadPrices holds the prices; agoq.search.cost_model builds a problem with
them)."""

from __future__ import annotations

from typing import Optional

from agoq.formats.profile import ProfileData
from agoq.search.problem import OffloadPrices, ProblemSettings
from agoq.search.timing import EAGER_SPREAD_NOTE, prices
from agoq.vocabulary import FSDP2_LAYOUTS

OVERLAP = 1.0  # the share of a micro-batch's step the host link's copies may run under (offload_prices)


def offload_prices(profile: ProfileData, knobs: ProblemSettings, base_seconds: float, accum: int, stages: int,
                   layout: str, notes: list, compile_mode: str, micro_batch: int) -> Optional[OffloadPrices]:
    """What offload costs under these knobs (agoq.search.problem.OffloadPrices), None where it is not offered: not
    asked for, no host link in the profile (a CPU profile, or one made before agoq measured it), or a layout the
    runtime cannot offload in (pipeline stages, fsdp, hsdp).

    The window per micro-batch is this step per micro-batch (OVERLAP of it) less the first layer (its own backward
    is the last, with nothing after it to hide a copy under): a layer's copy out runs under the forward of the
    layers above, the head and the start of backward, its copy back under the backward of the layers above. (With
    the decoder layers' share of the step as the window, the H100 probe's compiled offloading step at 1 x 2 was
    charged 31 ms of link time for 15 layers where the whole step took 23 ms more than kept, leaving nothing per
    layer; a plan offloading 8 layers then paid 23.5 ms where 1.3 was priced.) The compute slowdown the profile
    measured while both copies ran is charged for as long as the copies run. What the link copies out during
    forward (a third of the layers' share of the step: 3 x the profile's summed layer forward times against its
    eager bf16 step at the profiled micro-batch, at most 0.95; at the device-to-host rate) bounds what leaves the GPU
    by the end of forward: the rest is still there at forward's peak.

    What the link model leaves out is the runtime's own time per offloaded layer: its hooks and a copy per tensor,
    each direction, which a step whose kernels are short cannot hide (the 129 M byte LLaMA at micro-batch 1 x 4,
    10 layers offloaded: 165 ms against 80 ms kept, with 0.13 GB per micro-batch on a 50 GB/s link). The profile
    measures agoq-paper with its first K layers offloaded beside the same step kept (agoq.search.timing
    `offload_step`) in each compile mode at each micro-batch, with one and two micro-batches per step; what that
    step took beyond the kept one and beyond what the link model prices for its bytes is charged per offloaded layer:

      layer seconds (a micro-batches) = max(0, T_offloaded - T_kept - a x (exposed(B) + slowdown x B / rate)) / K

    at the plan's compile mode and micro-batch (another micro-batch's, the largest, where this one failed), and at
    other accumulations on the line through one and two micro-batches (as agoq.search.timing prices steps: a step
    of several micro-batches offloads at a cost that one micro-batch does not show). A profile with offloading
    steps but none of this compile mode (or of two micro-batches, for an accumulating plan) offers no offload there,
    and a profile made before agoq measured them none at all, with a note: without them the least peak of an
    offloading step is not known either (OffloadPrices.floor_bytes; the probe's plan at 9.70 GB from such a profile
    peaked at 10.31 GB, where a profile with them predicts 10.25)."""
    if not knobs.allow_offload:
        return None
    link = profile.host_link
    if not link:
        return None
    if stages > 1 or layout in FSDP2_LAYOUTS:
        notes.append("offload to host memory is not offered: the runtime offloads in one process or under DDP, "
                     "not across pipeline stages or under fsdp or hsdp")
        return None
    per_byte = 1.0 / float(link["d2h_bytes_per_second"]) + 1.0 / float(link["h2d_bytes_per_second"])
    L = profile.num_layers
    forward = (profile.header.get("timing") or {}).get("layer_forward_seconds") or []
    sp = prices(profile)
    eager = sp.seconds("eager", sp.m0, 1) if len(forward) == L else None
    if eager:
        share = min(0.95, 3.0 * float(sum(forward)) / float(eager))
    else:
        share = 0.6
        notes.append("the profile has no layer forward times or eager bf16 step: the decoder layers are taken as 0.6 "
                     "of the step, which bounds what offload copies out during forward")
    per_micro_batch = base_seconds / max(accum, 1) * (L - 1) / max(L, 1)  # the step per micro-batch, less layer 0
    window = OVERLAP * per_micro_batch
    host = knobs.host_budget if knobs.host_budget is not None else float(link.get("pinnable_bytes") or 0)
    slowdown = max(0.0, float(link.get("compute_slowdown") or 0.0))
    # what leaves during forward: a third of the layers' share of the step, at the device-to-host rate
    forward_bytes = share * per_micro_batch / 3.0 * float(link["d2h_bytes_per_second"])
    layer = _offload_layer_seconds(sp, compile_mode, micro_batch, accum, per_byte, slowdown, L, notes)
    if layer is None:
        return None
    return OffloadPrices(per_byte, window, slowdown * per_byte * accum, host, accum, forward_bytes,
                         layer_seconds=layer)


def _offload_layer_seconds(sp, compile_mode: str, micro_batch: int, accum: int, per_byte: float, slowdown: float,
                           layers: int, notes: list) -> Optional[float]:
    """Seconds per offloaded layer and step (at `accum` micro-batches) beyond the link model (offload_prices), None:
    not offered."""
    if not sp.offload_rows:  # measured or not offered: neither its time per layer nor its peak is known
        notes.append("offload to host memory is not offered: the profile measured no offloading step (it was made "
                     "before agoq measured them), so neither the runtime's time per offloaded layer nor the least "
                     "peak of an offloading step is known (a plan of the probe priced without them peaked 0.61 GB "
                     "over its budget); profile again to offer it")
        return None

    def charge(m: int, a: int) -> Optional[float]:
        step = sp.offload_step(compile_mode, m, a)
        if step is None:
            return None
        window = OVERLAP * step["kept"] / a * (layers - 1) / max(layers, 1)
        model = a * (max(0.0, step["bytes"] * per_byte - window) + slowdown * per_byte * step["bytes"])
        return max(0.0, step["offloaded"] - step["kept"] - model) / step["layers"]

    def at(m: int) -> Optional[float]:
        one = charge(m, 1)
        if one is None or accum == 1:
            return one
        two = charge(m, 2)
        return None if two is None else max(0.0, one + (two - one) * (accum - 1))

    mine = at(micro_batch)
    if mine is not None:
        if compile_mode == "eager":
            _note_offload_spread(sp, micro_batch, (1, 2) if accum > 1 else (1,), notes)
        return mine
    others = [c for m in range(1, sp.m0 + 1) if (c := at(m)) is not None]
    if not others:
        notes.append(f"offload to host memory is not offered {compile_mode} at {accum} micro-batch(es) per step: "
                     f"the profile measured no {compile_mode} offloading step to price it from")
        return None
    return max(others)


def _note_offload_spread(sp, micro_batch: int, accums: tuple, notes: list) -> None:
    """Note the eager offloading steps an offload price at `micro_batch` is read from whose times ranged more than
    EAGER_SPREAD_NOTE, within a run or between the profile's passes (priced from their mean, agoq.search.timing):
    offload's hooks and copies add host work to a step the host already sets (the probe on an H100, 1 x 2, 15
    layers offloaded: passes of 234.9 and 283.9 ms; a plan priced from the first ran 242-286 ms over a run)."""
    for a in accums:
        row = sp.offload_row("eager", micro_batch, a)
        if row is None:
            continue
        times = [float(t) for t in sp.steady(row) + list(row.get("repeat_step_seconds") or []) if t and t > 0]
        if len(times) < 2 or max(times) <= (1 + EAGER_SPREAD_NOTE) * min(times):
            continue
        notes.append(f"the eager offloading step at micro-batch {micro_batch} x {a} ({row['offload_layers']} layers "
                     f"offloaded) measured {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms across its steps and "
                     f"passes ({max(times) / min(times) - 1:.0%} apart) and is priced from the mean of its passes: an "
                     "eager plan that offloads is set by the host, and a run may miss its predicted step by as much")


__all__ = ["OVERLAP", "offload_prices"]
