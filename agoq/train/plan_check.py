"""What a run with a plan measured against what the plan predicted: `agoq train --plan` closes the loop.

After each step the run knows its peak (the largest allocated bytes of any step so far, the first included: it
compiles and allocates the optimizer state) and its step time (`steady_seconds`: the median of the second half of
the steps so far, the steady state; a process whose compiled graphs came from Inductor's cache can run its first
seconds of steps slower, agoq.runtime.activations.compile). Once
CHECK_STEPS steps have run (or the run ends sooner), and again at the end, it compares them with the plan's
predictions and its budget:

  peak      measured largest peak per stage  vs  predicted peak of that stage and the plan's budget
  step      median step seconds               vs  predicted step seconds

and writes the comparison into run.json (`plan_check`, docs/formats.md), which the dashboard's run page shows. It
warns on stderr when the measured peak passes the budget (a later step could run out of memory where the plan
said it fits) or the step is more than STEP_TOLERANCE off the prediction, and, from the start, when the plan was
searched from a profile measured on another device (`source.device`, plan schema 1.6) than the run's: the probe's
plans from an H200 profile ran 2-6 % slower than predicted on an H100. `agoq search --runs RUN...` takes these
measurements back into the search's calibration.

A run on the CPU records its step against the prediction but is not warned about it: there agoq's quantization runs as
its PyTorch reference code (agoq.runtime.quant.reference), not its GPU kernels, and the step model, which prices a layer's
options alike (agoq.search.timing), does not hold: `agoq demo`'s CPU plan ran -45 % and +120 % off its CPU profile's
prediction in two demos. A CPU run checks that training with a plan works; its step says nothing of a GPU's.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

CHECK_STEPS = 40      # steps after which the first comparison is made and said
STEP_TOLERANCE = 0.05  # a measured step further than this from the prediction is warned about


def steady_seconds(seconds: list[float]) -> list[float]:
    """The steps a run's step time is judged on: the second half (the first step excluded where there are fewer
    than 5, unless it is the only one)."""
    if len(seconds) > 4:
        return seconds[len(seconds) // 2:]
    return seconds[1:] or seconds


class PlanCheck:
    """Measured peaks and step times of a run with a plan, compared with the plan (see the module docstring)."""

    def __init__(self, plan, stage: Optional[int] = None, peaks: bool = True, device: Optional[str] = None):
        self.plan = plan
        self.stage = stage  # a pipeline's stage of this rank (None: the largest stage's prediction)
        self.measures_peaks = peaks  # False: the step's peak is no allocator figure (a CPU), not compared
        self.device = device  # the run's device: its GPU's name, or "cpu" (None: not known)
        self.warns_steps = (device or "").strip().lower() != "cpu"  # a CPU's step is recorded, not warned about
        self.peaks: list[int] = []
        self.seconds: list[float] = []
        self.warned = False  # a comparison's warnings were said (later comparisons only record theirs)

    def device_warning(self) -> Optional[str]:
        """A sentence when the plan's profile was measured on another device than this run's, else None."""
        theirs = self.plan.source.device
        if not theirs or not self.device or theirs.strip().lower() == self.device.strip().lower():
            return None
        offloads = any(lp.offload for lp in self.plan.layers)
        return (f"the plan was searched from a profile measured on {theirs}, and this run is on {self.device}: its "
                "step times" + (" and the host link its offload was priced with" if offloads else "")
                + " hold for that device; profile this one (agoq profile) and search again")

    def add(self, seconds: float, peak_bytes: list) -> None:
        """One step: its seconds and its peak per rank (None where not measured, e.g. a CPU)."""
        self.seconds.append(float(seconds))
        known = [p for p in peak_bytes if p is not None]
        if known and self.measures_peaks:
            self.peaks.append(int(max(known)))

    def due(self, steps_done: int, total_steps: int) -> bool:
        """Whether to compare now: after CHECK_STEPS steps, and at the end."""
        return steps_done == min(CHECK_STEPS, total_steps) or steps_done == total_steps

    def report(self) -> dict[str, Any]:
        """The comparison (run.json's `plan_check`): measured and predicted peak and step, the budget, the ratios,
        and `warnings` (sentences; empty when the run is within the plan)."""
        predicted = self.plan.predicted
        peaks = predicted.peak_bytes_per_stage or []
        predicted_peak = (peaks[self.stage] if self.stage is not None and self.stage < len(peaks)
                          else max(peaks) if peaks else None)
        timed = steady_seconds(self.seconds)
        out: dict[str, Any] = {
            "steps": len(self.seconds), "budget_bytes": self.plan.budget_bytes,
            "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": max(self.peaks) if self.peaks else None,
            "first_step_peak_bytes": self.peaks[0] if self.peaks else None,
            "predicted_step_seconds": predicted.step_seconds,
            "measured_step_seconds": statistics.median(timed) if timed else None, "warnings": [],
            "plan_device": self.plan.source.device, "device": self.device}
        if (elsewhere := self.device_warning()) is not None:
            out["warnings"].append(elsewhere)
        measured_peak, budget = out["measured_peak_bytes"], out["budget_bytes"]
        if measured_peak is not None and predicted_peak:
            out["peak_error"] = measured_peak / predicted_peak - 1
        if measured_peak is not None and budget and measured_peak > budget:
            out["warnings"].append(f"the measured peak {measured_peak:,} bytes passes the plan's budget of {budget:,} "
                                   f"(predicted {predicted_peak:,}): a later step may run out of memory; search "
                                   "again with the run's measurements (agoq search --runs RUN_DIR) or a smaller budget")
        if out["measured_step_seconds"] and predicted.step_seconds:
            out["step_error"] = out["measured_step_seconds"] / predicted.step_seconds - 1
            if abs(out["step_error"]) > STEP_TOLERANCE and self.warns_steps:
                out["warnings"].append(
                    f"the measured step {out['measured_step_seconds'] * 1e3:.1f} ms is {out['step_error']:+.1%} off "
                    f"the plan's {predicted.step_seconds * 1e3:.1f} ms (more than {STEP_TOLERANCE:.0%}): agoq search --runs "
                    "RUN_DIR prices the next search from this run")
        return out


__all__ = ["PlanCheck", "CHECK_STEPS", "STEP_TOLERANCE", "steady_seconds"]
