"""Peaks a plan can be budgeted by: the memory model of agoq.search.costs calibrated on the peaks the profile
measured (agoq.formats.measured_steps), per compile mode and batch split, with a margin learnt from its misses.

The model counts what agoq's eager runtime keeps. A compiled layer keeps less (torch.compile's partitioner saves
fewer tensors of an unmodified layer and recomputes cheap ones), and what a layer under LAAQ or a checkpointed
layer keeps differs again. At a compile mode c and split (m, a) the profile measured three anchors at its base
knobs: every layer unmodified (bf16), under LAAQ (agoq-paper) and checkpointed (checkpoint-all). For each anchor
with a measured peak that the model places in forward or backward (not in the optimizer step),

    k = (model's peak - measured peak) / layers          bytes the model over-counts per layer of that kind

and a plan's peak is the model's less k16 per unmodified layer, kC per checkpointed layer and kQ per layer under
LAAQ. kQ is applied only where it adds bytes (kQ < 0): a per-LAAQ-layer correction is a constant of the problem
that the peak during a checkpointed layer's backward would also receive for layers not yet run, so a saving there
is not counted (the model's own LAAQ bytes are then an upper bound). An anchor not measured gives k = 0.

The checkpoint-all anchor usually peaks in the backward of a checkpointed layer (checkpoint_backward), where the
step holds the checkpointed inputs, one layer's rerun forward and every gradient made so far, not L layers of
anything: its miss there is not a per-layer amount (spread over L layers it would move the end of forward of a plan
with many checkpointed layers by L times what it moves that anchor). It is then a constant of that phase,

    r = measured peak - calibrated model's checkpoint_backward peak (k16, kQ applied, kC = 0)

added to the backward of every checkpointed layer (`ChoiceProblem.rerun_calibration`), so that the calibrated
model reproduces the anchor; kC is 0. (On the 129 M byte LLaMA at micro-batch 1 x 2 the model counted the
anchor's end of backward 99 MB high; spread as 9.9 MB per layer it had taken 69 MB off the end of forward of a plan
with 7 checkpointed layers, which then peaked 24 MB above its prediction.)

Margin. Every other step the profile measured in mode c with a peak (other optimizers, masters, gradient storage,
splits) is predicted with the calibrated model; the largest amount by which a measured peak exceeds its
prediction is added to every plan's peak of that mode (0 when the model never under-predicts), and the plan's
notes say so. Combinations the profile did not measure miss by more: the margin is at least MARGIN_FLOOR of the
mode's smallest measured peak (the tight end, where a margin decides a plan). On the probe (one H200) a plan of
QuanGrad, full checkpointing and micro-batch 1 x 2, none of which the profile measured together, peaked 0.55 %
above its prediction while every measured step was predicted within 2 MB (`plan_accuracy_probe_phase.json`).
Steps' peaks are the largest of any step, the first included (agoq.formats.measured_steps).

Offload. With activations in host memory a step's peak comes at the end of backward, every gradient made, which
offload does not lower (the 129 M byte LLaMA at micro-batch 4: agoq-paper with 9 of 10 layers offloaded peaked at
1.531 GB, full checkpointing at 1.532). The model, which takes an offloaded layer's bytes off the end of forward,
does not see that; the profile's offloading step (agoq-paper, every layer but the last offloaded, at this compile
mode and micro-batch, with one micro-batch per step or two for an accumulating plan) measured it. Its peak, moved
by the model's state bytes between its knobs and the plan's (gradient storage, optimizer, masters, accumulated
gradients), is the least peak of any choice that offloads (`OffloadPrices.floor_bytes`).

What an offloaded layer's backward allocates beyond its fetched tensors (dequantized copies, its activations'
gradients) is not in the per-layer bytes: it is the profile's offloading step's peak less the calibrated model's
level in the backward of that step's offloaded layers 0 and 1 (`OffloadPrices.backward_bytes`), plus the spread of
that peak, which the copies' timing moves between runs: its passes' spread, at least OFFLOAD_SPREAD_FLOOR of it.

Runs. Runs of plans made from the profile (`ProfileData.runs`: `agoq search --runs DIR...`, read by
agoq.formats.run.measured_against_plan) are what really ran: each plan is priced again with the calibrated model;
a measured peak above its prediction raises the margin as a measured step does, and at each compile mode and
split the median of measured / predicted step seconds over its runs scales every step time priced there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from agoq.runtime.activations.policy import KINDS
from agoq.formats.measured_steps import POLICIES
from agoq.formats.profile import ProfileData
from agoq.search.cost_model import model_problem
from agoq.search.problem import ChoiceProblem, ProblemSettings, recipe_choice
from agoq.search.timing import prices

NOT_MEASURED = {**{policy: 0.0 for policy in POLICIES}, "checkpoint_phase": 0.0}
MARGIN_FLOOR = 0.006  # of the smallest measured peak (module docstring)
# of the offloading step's peak, added to what an offloaded layer's backward allocates (module docstring): where the
# copies end sets when copied-out and fetched tensors are freed, so an offloading step's peak moves between runs. The
# H100 probe's offloading step (15 layers at micro-batch 2, compiled) peaked at 10.245 GB in its profile and at
# 10.306 GB on another H100 the next day, and plans whose peak is an offloaded layer's backward came 9-27 MB under
# the phase priced from the second (experiments/results/memory_peak_trace_probe_h100_*.json)
OFFLOAD_SPREAD_FLOOR = 0.01


def _anchor_row(profile: ProfileData, compile_mode: str, policy: str, micro_batch: int,
                grad_accum: int) -> Optional[dict]:
    """The measured anchor whose peak holds at (m, a): the row of exactly that split, else (peaks do not grow with
    more micro-batches) one of the same micro-batch that also accumulates (a >= 2) or also does not (a = 1)."""
    sp = prices(profile)
    base = sp.base(compile_mode)
    if base is None:
        return None
    rows = [r for r in sp.rows if (r["compile"], r["policy"], r["micro_batch"], r["gradients"], r["optimizer"],
                                   r["master"], r["activation_memory_budget"])
            == (compile_mode, policy, micro_batch, "bf16", *base, None) and r.get("peak_bytes") is not None]
    exact = [r for r in rows if r["grad_accum"] == grad_accum]
    alike = [r for r in rows if (r["grad_accum"] >= 2) == (grad_accum >= 2)]
    return (exact or sorted(alike, key=lambda r: r["grad_accum"]) or [None])[0]


def _row_knobs(profile: ProfileData, row: dict) -> ProblemSettings:
    return ProblemSettings(micro_batch=row["micro_batch"], grad_accum=row["grad_accum"], gradient_mode=row["gradients"],
                           optimizer=row["optimizer"], master=row["master"], compile_mode=row["compile"],
                           layer_stage=(0,) * profile.num_layers)


def _choice(problem: ChoiceProblem, policy: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(chosen options, checkpointed layers) of an anchor policy in `problem`, None when it cannot express it."""
    L = problem.num_layers
    if policy == "bf16":
        return np.nonzero(problem.keeps_16bit())[0], np.zeros(L, dtype=bool)
    if policy == "checkpoint-all":
        return (np.array([], dtype=int), np.ones(L, dtype=bool)) if problem.allow_checkpoint else None
    chosen = recipe_choice(problem)
    return None if chosen is None else (chosen, np.zeros(L, dtype=bool))


def _model_peak(problem: ChoiceProblem, policy: str) -> Optional[tuple[int, str]]:
    choice = _choice(problem, policy)
    if choice is None:
        return None
    figures = problem.evaluate(*choice)
    return max(figures["peak_bytes_per_stage"]), figures["peak_phase_per_stage"][0]


def corrections(profile: ProfileData, compile_mode: str, micro_batch: int, grad_accum: int) -> dict[str, float]:
    """{policy: k} of the module docstring at (compile mode, m, a), bytes per layer (cached on the profile)."""
    cache = profile.cache.setdefault("calibration", {})
    key = (compile_mode, micro_batch, grad_accum)
    if key in cache:
        return cache[key]
    out = dict(NOT_MEASURED)
    phase_anchor = None  # (problem, row) of a checkpoint-all anchor that peaks in checkpoint_backward
    for policy in POLICIES:
        row = _anchor_row(profile, compile_mode, policy, micro_batch, grad_accum)
        if row is None:
            continue
        try:
            problem = model_problem(profile, _row_knobs(profile, row))
            model = _model_peak(problem, policy)
        except ValueError:
            continue
        if model is None or model[1] == "optimizer_step":
            continue
        if policy == "checkpoint-all" and model[1] == "checkpoint_backward":
            phase_anchor = (problem, row)
        else:
            out[policy] = (model[0] - float(row["peak_bytes"])) / profile.num_layers
    if phase_anchor is not None:
        problem, row = phase_anchor
        _apply(problem, out)
        chosen, ckpt = _choice(problem, "checkpoint-all")
        during = float(problem._memory(chosen, ckpt)["checkpoint_peak"][0])
        if np.isfinite(during):
            out["checkpoint_phase"] = float(row["peak_bytes"]) - during
    cache[key] = out
    return out


def _apply(problem: ChoiceProblem, k: dict[str, float]) -> None:
    """Take the corrections `k` off `problem`'s memory terms (one stage; see the module docstring)."""
    laaq = min(k["agoq-paper"], 0.0)
    problem.static_bytes = problem.static_bytes - problem.num_layers * laaq
    problem.static_parts["calibration"] = np.full(problem.num_stages, -problem.num_layers * laaq)
    problem.unmodified_calibration = np.full(problem.num_layers, laaq - k["bf16"])
    problem.checkpoint_calibration = np.full(problem.num_layers, laaq - k["checkpoint-all"])
    problem.rerun_calibration = np.full(problem.num_layers, k.get("checkpoint_phase", 0.0))


def choice_of_plan(problem: ChoiceProblem, plan: dict) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(chosen options, checkpointed layers) of a plan's layers (JSON data) in `problem`; None when the problem
    lacks one of its options."""
    layers = plan.get("layers") or []
    if len(layers) != problem.num_layers:
        return None

    ckpt = np.array([bool(lp.get("checkpoint")) for lp in layers])
    chosen = []
    for (layer, kind), options in sorted(problem.groups().items()):
        if ckpt[layer]:
            continue
        want = str((layers[layer].get("kinds") or {}).get(KINDS[kind], 16))
        match = [i for i in options if problem.option[i] == want]
        if not match:
            return None
        chosen.append(match[0])
    return np.array(chosen, dtype=int), ckpt


def _run_knobs(profile: ProfileData, plan: dict) -> ProblemSettings:
    training, optimizer = plan.get("training") or {}, plan.get("optimizer") or {}
    return ProblemSettings(micro_batch=training.get("micro_batch"), grad_accum=int(training.get("grad_accum", 1)),
                           gradient_mode=(plan.get("gradients") or {}).get("mode", "bf16"),
                           optimizer=optimizer.get("name"), master=optimizer.get("master"),
                           compile_mode=training.get("compile", "eager"),
                           block=(plan.get("activations") or {}).get("block"),
                           format=(plan.get("activations") or {}).get("format", "int"),
                           layer_stage=(0,) * profile.num_layers)


def priced_runs(profile: ProfileData, compile_mode: str) -> list[dict]:
    """The profile's runs of `compile_mode` priced again with the calibrated model (no margin, no run factor): each
    with `predicted_peak_bytes` and `predicted_step_seconds` (cached on the profile)."""
    cache = profile.cache.setdefault("priced_runs", {})
    if compile_mode in cache:
        return cache[compile_mode]
    out = []
    for run in profile.runs:
        plan = run["plan"]
        if run.get("fingerprint") != profile.fingerprint or (plan.get("training") or {}).get("compile") != compile_mode:
            continue
        try:
            knobs = _run_knobs(profile, plan)
            problem = model_problem(profile, knobs)
        except ValueError:
            continue
        _apply(problem, corrections(profile, compile_mode, problem_micro_batch(profile, knobs), knobs.grad_accum))
        choice = choice_of_plan(problem, plan)
        if choice is None:
            continue
        figures = problem.evaluate(*choice)
        out.append({**run, "predicted_peak_bytes": max(figures["peak_bytes_per_stage"]),
                    "predicted_step_seconds": figures["step_seconds"],
                    "split": (problem_micro_batch(profile, knobs), knobs.grad_accum)})
    cache[compile_mode] = out
    return out


def problem_micro_batch(profile: ProfileData, knobs: ProblemSettings) -> int:
    return int(knobs.micro_batch or profile.settings.get("micro_batch", 1) or 1)


def time_factor(profile: ProfileData, compile_mode: str, micro_batch: int, grad_accum: int) -> tuple[float, int]:
    """(median of measured / predicted step seconds of the profile's runs at this mode and split, how many runs);
    (1, 0) without runs there."""
    ratios = sorted(r["step_seconds"] / r["predicted_step_seconds"] for r in priced_runs(profile, compile_mode)
                    if r["split"] == (micro_batch, grad_accum) and r.get("step_seconds")
                    and r["predicted_step_seconds"] > 0)
    if not ratios:
        return 1.0, 0
    mid = len(ratios) // 2
    return (ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2), len(ratios)


def _corrected_row_problem(profile: ProfileData, row: dict) -> Optional[ChoiceProblem]:
    """The problem of a measured step's knobs with the per-layer corrections at its split and no margin (None where
    the profile cannot price those knobs)."""
    try:
        problem = model_problem(profile, _row_knobs(profile, row))
    except ValueError:
        return None
    _apply(problem, corrections(profile, row["compile"], row["micro_batch"], row["grad_accum"]))
    return problem


def margin(profile: ProfileData, compile_mode: str) -> tuple[float, Optional[dict]]:
    """(the margin of the module docstring in bytes, the measured step missed by most, or {"floor": True, ...} where
    the floor is larger, or None), cached."""
    cache = profile.cache.setdefault("margin", {})
    if compile_mode in cache:
        return cache[compile_mode]
    worst, worst_row = 0.0, None
    for row in prices(profile).rows:
        if row["compile"] != compile_mode or row.get("peak_bytes") is None or row["activation_memory_budget"]:
            continue
        problem = _corrected_row_problem(profile, row)
        if problem is None:
            continue
        model = _model_peak(problem, row["policy"])
        if model is None:
            continue
        missed = float(row["peak_bytes"]) - model[0]
        if missed > worst:
            worst, worst_row = missed, {**row, "predicted_peak_bytes": model[0]}
    for run in priced_runs(profile, compile_mode):
        if run.get("peak_bytes") is not None and run["peak_bytes"] - run["predicted_peak_bytes"] > worst:
            worst = run["peak_bytes"] - run["predicted_peak_bytes"]
            worst_row = {"policy": f"run {run['run']}", "micro_batch": run["split"][0], "grad_accum": run["split"][1],
                         "gradients": (run["plan"].get("gradients") or {}).get("mode"),
                         "optimizer": (run["plan"].get("optimizer") or {}).get("name"),
                         "master": (run["plan"].get("optimizer") or {}).get("master"),
                         "predicted_peak_bytes": run["predicted_peak_bytes"], "peak_bytes": run["peak_bytes"]}
    measured = [float(r["peak_bytes"]) for r in prices(profile).rows
                if r["compile"] == compile_mode and r.get("peak_bytes") is not None]
    if measured and MARGIN_FLOOR * min(measured) > worst:
        worst, worst_row = MARGIN_FLOOR * min(measured), {"floor": True, "smallest_peak_bytes": min(measured)}
    cache[compile_mode] = (worst, worst_row)
    return worst, worst_row


def _offloading_step(profile: ProfileData, compile_mode: str, micro_batch: int, grad_accum: int):
    """(the profile's measured offloading step with a peak for a plan of this split: one micro-batch per step, or
    for an accumulating plan two, else one; its cache key), (None, None) where none was measured."""
    sp = prices(profile)
    for a in ((1,) if grad_accum == 1 else (2, 1)):
        row = sp.offload_row(compile_mode, micro_batch, a)
        if row is not None and row.get("peak_bytes") is not None:
            return row, (compile_mode, micro_batch, row["grad_accum"])
    return None, None


def _offload_step_name(row: dict) -> str:
    return (f"the profile's {row['compile']} agoq-paper step with {row['offload_layers']} layers offloaded "
            f"(micro-batch {row['micro_batch']} x {row['grad_accum']})")


def offload_floor(profile: ProfileData, static_bytes: float, compile_mode: str, micro_batch: int,
                  grad_accum: int) -> Optional[tuple[float, dict]]:
    """(the least peak of a choice that offloads, the measured offloading step it comes from) for a problem whose
    uncalibrated static bytes are `static_bytes` (module docstring), None where no such step was measured."""
    row, key = _offloading_step(profile, compile_mode, micro_batch, grad_accum)
    if row is None:
        return None
    cache = profile.cache.setdefault("offload_floor_static", {})
    if key not in cache:
        knobs = replace(_row_knobs(profile, row), allow_offload=False)
        cache[key] = float(model_problem(profile, knobs).static_bytes[0])
    return float(row["peak_bytes"]) + static_bytes - cache[key], row


def offload_backward_bytes(profile: ProfileData, compile_mode: str, micro_batch: int,
                           grad_accum: int) -> Optional[tuple[float, dict]]:
    """(what an offloaded layer's backward allocates beyond its fetched tensors, the measured offloading step it comes
    from): that step's peak less the calibrated model's level in the backward of its offloaded layers 0 and 1
    (ChoiceProblem's phase offload_backward at a layer, with nothing allocated on top), at least 0, plus the
    spread of that peak: its passes' (`repeat_peak_bytes`), at least OFFLOAD_SPREAD_FLOOR of it. None where no such
    step was measured (cached on the profile)."""
    row, key = _offloading_step(profile, compile_mode, micro_batch, grad_accum)
    if row is None:
        return None
    cache = profile.cache.setdefault("offload_backward", {})
    if key not in cache:  # made whole, then kept: threads share the profile (a placeholder would be read as "none")
        cache[key] = _offload_backward(profile, row)
    return None if cache[key] is None else (cache[key], row)


def _offload_backward(profile: ProfileData, row: dict) -> Optional[float]:
    """offload_backward_bytes' figure for the offloading step `row`, uncached (None where it cannot be priced)."""
    problem = _corrected_row_problem(profile, row)
    if problem is None:
        return None
    choice = _choice(problem, "agoq-paper")
    layers = int(row.get("offload_layers") or 0)
    if problem.offload is None or choice is None or not 0 < layers <= problem.num_layers:
        return None
    problem.offload = replace(problem.offload, backward_bytes=0.0, floor_bytes=0.0)
    m = problem._memory(*choice, np.arange(problem.num_layers) < layers)
    level = float(m["level_at_offloaded"][0])
    if not np.isfinite(level):
        return None
    passes = [float(v) for v in row.get("repeat_peak_bytes") or []]
    spread = max(OFFLOAD_SPREAD_FLOOR * float(row["peak_bytes"]), max(passes) - min(passes) if passes else 0.0)
    return max(0.0, float(row["peak_bytes"]) - level) + spread


def calibrate_problem(problem: ChoiceProblem, profile: ProfileData, knobs: ProblemSettings, compile_mode: str,
                      micro_batch: int, grad_accum: int) -> None:
    """Calibrate `problem` (built for `knobs`) in place: the corrections at its split, the mode's margin and the
    floor of choices that offload."""
    if problem.num_stages != 1:
        return  # the anchors are one-process steps of the whole model
    if problem.offload is not None:
        found = offload_backward_bytes(profile, compile_mode, micro_batch, grad_accum)
        if found is not None:
            d, row = found
            problem.offload = replace(problem.offload, backward_bytes=d)
            problem.notes.append(
                f"an offloaded layer's backward allocates {int(d)} bytes beyond its tensors: {_offload_step_name(row)} "
                "peaked that far above the model's level in the backward of its offloaded layers 0 and 1, its spread "
                f"between runs included (at least {OFFLOAD_SPREAD_FLOOR:.0%} of its peak)")
        found = offload_floor(profile, float(problem.static_bytes[0]), compile_mode, micro_batch, grad_accum)
        if found is not None:
            floor, row = found
            problem.offload = replace(problem.offload, floor_bytes=floor)
            problem.notes.append(
                f"a plan that offloads peaks at no less than {int(floor)} bytes: {_offload_step_name(row)} peaked at "
                f"{int(row['peak_bytes'])} bytes, at the end of backward, which offload does not lower")
    k = corrections(profile, compile_mode, micro_batch, grad_accum)
    if any(k.values()):
        _apply(problem, k)
        said = []
        per_layer = [f"{what} {v / 2**20:+.1f} MiB" for what, v in
                     (("unmodified", k["bf16"]), ("under LAAQ", k["agoq-paper"]), ("checkpointed", k["checkpoint-all"]))
                     if v]
        if per_layer:
            said.append("per layer the model counted " + ", ".join(per_layer) + " more than measured")
        if k["checkpoint_phase"]:
            said.append(f"the backward of a checkpointed layer adds {k['checkpoint_phase'] / 2**20:+.1f} MiB (the "
                        "measured checkpoint-all step's peak less the model's)")
        problem.notes.append(f"{compile_mode} peaks calibrated on the profile's measured steps at micro-batch "
                             f"{micro_batch} x {grad_accum}: " + "; ".join(said))
    factor, runs = time_factor(profile, compile_mode, micro_batch, grad_accum)
    if runs:
        problem.base_seconds *= factor
        problem.seconds = problem.seconds * factor
        problem.checkpoint_seconds = problem.checkpoint_seconds * factor
        problem.laaq_layer_seconds *= factor
        problem.notes.append(f"{compile_mode} step times at micro-batch {micro_batch} x {grad_accum} scaled by "
                             f"{factor:.3f}: the median of measured / predicted over {runs} run(s) of plans from this "
                             "profile")
    extra, row = margin(profile, compile_mode)
    if extra > 0:
        problem.static_bytes = problem.static_bytes + extra
        problem.static_parts["margin"] = np.full(problem.num_stages, extra)
        problem.notes.append(
            f"peak margin of {int(extra)} bytes: {MARGIN_FLOOR:.1%} of the smallest measured {compile_mode} peak "
            f"({int(row['smallest_peak_bytes'])} bytes), for combinations the profile did not measure; the "
            f"calibrated model predicts every measured {compile_mode} step within that" if row.get("floor") else
            f"peak margin of {int(extra)} bytes: the calibrated model predicted the profile's measured {compile_mode} "
            f"{row['policy']} step (micro-batch {row['micro_batch']} x {row['grad_accum']}, gradients "
            f"{row['gradients']}, {row['optimizer']}, masters {row['master']}) at {int(row['predicted_peak_bytes'])} "
            f"bytes, it peaked at {int(row['peak_bytes'])}")
    elif any(r.get("peak_bytes") is not None for r in prices(profile).rows if r["compile"] == compile_mode):
        problem.notes.append(f"peak margin 0: the calibrated model predicts every measured {compile_mode} step at or "
                             "above its measured peak")


__all__ = ["calibrate_problem", "corrections", "margin", "offload_backward_bytes", "offload_floor"]
