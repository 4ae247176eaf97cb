"""Every layout calibrated on the profile's layout steps (profile.json `layout_steps`,
agoq.formats.layout_steps): what one GPU's calibration (agoq.search.calibration) does for the memory model and the
measured one-rank steps, done for each data-parallel layout's communication and peak per rank.

The cost model prices a layout's step as the compute the profile measured on one rank plus the communication its
collectives table leaves exposed (agoq.search.cost_model, agoq.search.layouts): no overlap with compute is learnt
from a real step, and DDP's buckets, FSDP2's units in flight or the sharded state are counted by model. A layout
step is a real step of that layout on every rank, at the profile's micro-batch, one micro-batch per step, every
layer kept, the base optimizer. For a configuration of layout D (its layout, gradient mode and weight gather) in
compile mode c, with R the layout step of D measured in c (else in the other compile mode, for its communication
only: the notes say so):

  anchor A  = R's configuration, priced by the calibrated one-rank model (agoq.search.calibration, no layout
              calibration): compute(A) = its step less its modelled communication comm(A), and its peak P(A)

  exposed   = max(0, R.step_seconds - compute(A))                       the communication R did not hide
  comm(X)   = max(0, exposed + comm_model(X) - comm_model(A))           X: any configuration of layout D
  step(X)   = compute(X) + comm(X)

  margin    = R.peak_bytes - P(A)                                       bytes per rank the model missed
  peak(X)   = model peak(X) + margin                                    every phase (the end of forward, a
                                                                        checkpointed layer's backward, the
                                                                        optimizer step)

so the calibrated price reproduces R's step (where it is no faster than compute(A)) and peak exactly at A, and moves
by the model's deltas elsewhere: another micro-batch, accumulation (DDP's all-reduce is once per step, so its
exposed seconds are amortized; FSDP2's all-gathers are per micro-batch, so the model's per-micro-batch exposure is
added for each further one), per-layer choices, checkpointing, optimizers. The margin may be negative (the model
over-counts, e.g. DDP's buckets): the peak is then predicted lower, as measured. Plans and alternatives are priced
through this (agoq.search.costs.build_problem), so both are calibrated alike. Pipeline stages are not calibrated
here (a layout step is one stage).

A what-if (agoq.search.whatif: a profile measured on W ranks re-targeted to N, `profile.measured` the profile as
measured) keeps R where it was measured: the anchor is priced on the measured profile, at W ranks with the
collectives W ranks measured, and only X is priced at N with the network model's collectives:

  hidden    = comm_model_W(A) - exposed                                 what compute hid at W (negative: what the
                                                                        model missed)
  comm(X)   = max(0, comm_model_N(X) - hidden)                          = exposed + comm_model_N(X) - comm_model_W(A)
  peak(X)   = model peak_N(X) + (R.peak_bytes - P_W(A))

Why so: the compute per rank is the same at N (every rank runs the same micro-batch), so the seconds of
communication it hid at W stay hidden, and what grows from W to N is the communication the network model prices
(its ring and tree terms, the nodes crossed); the measured exposure is carried as an offset, not a ratio (a ratio
would hide at N a share of a larger communication than the compute can cover). At N = W over the profile's own
fitted link the what-if reproduces the plain calibration within the fit's residuals. The peak's margin is bytes the
model missed at W (workspace, the allocator's rounding, DDP's buckets), kept as bytes per rank at N.

A profile of one GPU (W = 1) measures the fsdp layout steps as one-rank FSDP2 (FSDP2 in a group of one process,
agoq.commands.profile_layouts): its own plans are priced as before (fsdp is not offered at one rank, nothing is
calibrated), and a what-if re-targeted from it to N anchors its fsdp prices there. The anchor is priced at W = 1
without collectives (agoq.search.cost_model.model_problem's `one_rank`: the whole state on one rank, compute(A) =
fwd + bwd + the optimizer step of the whole state, seconds), so comm_model_1(A) = 0 and

  exposed   = max(0, R.step_seconds - compute(A))                       FSDP2's own cost per step, seconds: the
                                                                        copies in and out of every unit's
                                                                        all-gather and reduce-scatter, its hooks,
                                                                        the int8/int4 gathers' quantize and
                                                                        dequantize kernels
  comm(X)   = comm_model_N(X) + exposed                                 (hidden = -exposed: nothing was hidden)
  peak(X)   = model peak_N(X) + (R.peak_bytes - P_1(A))                 bytes per rank

TLq-HS's reduce-scatter of one rank returns the gradient as it is (agoq.runtime.comm.sdp4bit.tlq_hs), so the
sdp4bit rows carry FSDP2's own cost but not TLq-HS's quantize and Hadamard kernels (its wire time is the model's).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from agoq.formats.profile import ProfileData
from agoq.search.layouts import resolve_layout
from agoq.search.problem import ChoiceProblem, ProblemSettings


def layout_row(profile: ProfileData, layout: str, gradient_mode: str, weight_gather: str,
               compile_mode: str) -> Optional[dict]:
    """The profile's layout step of (layout, gradient mode, weight gather): the one measured in `compile_mode`,
    else one of another compile mode, else None."""
    cache = profile.cache.setdefault("layout_rows", {})
    if "rows" not in cache:
        cache["rows"] = profile.layout_steps()  # at one rank: one-rank FSDP2's (agoq.formats.layout_steps)
    rows = [r for r in cache["rows"] if (r["layout"], r["gradients"], r["weight_gather"])
            == (layout, gradient_mode, weight_gather)]
    return next((r for r in rows if r["compile"] == compile_mode), rows[0] if rows else None)


def row_knobs(profile: ProfileData, row: dict) -> ProblemSettings:
    """The knobs a layout step ran (every layer kept, on one stage, nothing offloaded)."""
    return ProblemSettings(micro_batch=row["micro_batch"], grad_accum=row["grad_accum"], gradient_mode=row["gradients"],
                           optimizer=row["optimizer"], master=row["master"], compile_mode=row["compile"],
                           layout=row["layout"], weight_gather=row["weight_gather"],
                           layer_stage=(0,) * profile.num_layers, allow_offload=False)


def anchor(profile: ProfileData, row: dict) -> Optional[dict]:
    """{"compute_seconds", "communication_seconds", "peak_bytes"} of R's configuration priced by the calibrated
    one-rank model (module docstring; on a profile of one rank, one-rank FSDP2: no communication); None where the
    profile cannot price it (cached on the profile)."""
    cache = profile.cache.setdefault("layout_anchor", {})
    key = repr(sorted((k, v) for k, v in row.items() if not isinstance(v, list)))
    if key not in cache:  # made whole, then kept: threads share the profile (a placeholder would be read as "none")
        cache[key] = _anchor(profile, row)
    return cache[key]


def _anchor(profile: ProfileData, row: dict) -> Optional[dict]:
    """`anchor`, uncached."""
    from agoq.search.calibration import calibrate_problem
    from agoq.search.cost_model import model_problem

    knobs = row_knobs(profile, row)
    try:
        problem = model_problem(profile, knobs, one_rank=profile.world_size == 1)
    except ValueError:
        return None
    calibrate_problem(problem, profile, knobs, row["compile"], row["micro_batch"], row["grad_accum"])
    figures = problem.evaluate(np.nonzero(problem.keeps_16bit())[0], np.zeros(problem.num_layers, dtype=bool))
    comm = float(problem.communication_seconds)
    return {"compute_seconds": float(figures["step_seconds"]) - comm, "communication_seconds": comm,
            "peak_bytes": float(max(figures["peak_bytes_per_stage"]))}


def calibrate_layout(problem: ChoiceProblem, profile: ProfileData, knobs: ProblemSettings, compile_mode: str) -> None:
    """Calibrate `problem` (built for `knobs`, already calibrated on one rank) in place on the profile's layout step
    of its layout (module docstring); nothing where the profile has none, or the problem has pipeline stages."""
    measured = profile.measured if profile.measured is not None else profile  # a what-if's: as measured
    if profile.world_size < 2 or problem.num_stages != 1:  # a profile of one rank plans no fsdp: nothing to calibrate
        return
    layout = resolve_layout(knobs.layout, knobs.gradient_mode)
    row = layout_row(measured, layout, knobs.gradient_mode, knobs.weight_gather, compile_mode)
    if row is None:
        return
    a = anchor(measured, row)
    if a is None:
        return
    what = (f"{layout} ({knobs.gradient_mode} gradients"
            + (f", {knobs.weight_gather} weight gather" if knobs.weight_gather != "bf16" else "") + ")")
    other = "" if row["compile"] == compile_mode else f" (measured {row['compile']}: its communication only)"
    exposed = max(0.0, float(row["step_seconds"]) - a["compute_seconds"])
    comm = max(0.0, exposed + float(problem.communication_seconds) - a["communication_seconds"])
    problem.base_seconds = problem.base_seconds + comm - float(problem.communication_seconds)
    at = "" if measured is profile else f" at {profile.world_size} ranks (the network model's)"
    step = (f"one-rank layout step (FSDP2 in one process: its own cost){other}" if measured.world_size == 1 else
            f"{measured.world_size}-rank layout step{other}")
    problem.notes.append(
        f"{what} communication calibrated on the profile's {step}: it measured "
        f"{row['step_seconds'] * 1e3:.4g} ms where the priced compute is {a['compute_seconds'] * 1e3:.4g} ms, "
        f"{exposed * 1e3:.4g} ms exposed (modelled {a['communication_seconds'] * 1e3:.4g} ms); here "
        f"{comm * 1e3:.4g} ms per step (modelled {problem.communication_seconds * 1e3:.4g} ms{at})")
    problem.communication_seconds = comm
    if row["compile"] != compile_mode or row.get("peak_bytes") is None:
        return
    margin = float(row["peak_bytes"]) - a["peak_bytes"]
    problem.static_bytes = problem.static_bytes + margin
    if problem.static_parts is not None:
        problem.static_parts["layout_margin"] = np.full(problem.num_stages, margin)
    if problem.floor_bytes is not None:
        problem.floor_bytes = problem.floor_bytes + margin
        if problem.floor_parts is not None:
            problem.floor_parts["layout_margin"] = np.full(problem.num_stages, margin)
    problem.notes.append(f"{what} peak per rank calibrated on the profile's layout step: it peaked at "
                         f"{int(row['peak_bytes'])} bytes on its largest rank, the model {int(a['peak_bytes'])}: "
                         f"{int(margin):+d} bytes on every phase")


__all__ = ["calibrate_layout", "layout_row", "anchor", "row_knobs"]
