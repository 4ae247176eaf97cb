"""The calibrated cost model: `build_problem` is the ChoiceProblem of a profile under some knobs
(agoq.search.cost_model: memory, step time and gradient error of every per-layer choice) calibrated on the profile's
measured peaks and steps (agoq.search.calibration) and, over several ranks, on its layout steps
(agoq.search.layout_calibration: each layout's exposed communication and peak per rank). The search, the one price (agoq.search.price) and the dashboard
build their problems here.
"""

from __future__ import annotations

from agoq.formats.measured_steps import COMPILE_MODES
from agoq.formats.profile import ProfileData
from agoq.search.calibration import calibrate_problem
from agoq.search.layout_calibration import calibrate_layout
from agoq.search.cost_model import ELEM_BYTES, gradient_modes, model_problem
from agoq.search.offload_prices import OVERLAP, offload_prices
from agoq.search.problem import ChoiceProblem, ProblemSettings, checkpointing_only, recipe_choice, recipe_error
from agoq.search.state import (
    measured_with,
    optimizer_choices,
    resolve_optimizer,
    state_parts,
    static_bytes_total,
)
from agoq.search.timing import EAGER_SPREAD_NOTE, compile_modes, profile_compile_mode


def build_problem(profile: ProfileData, knobs: ProblemSettings = ProblemSettings(), *,
                  calibrate: bool = True) -> ChoiceProblem:
    """The ChoiceProblem of a profile under `knobs` (agoq.search.cost_model), calibrated on the profile's measured
    peaks (agoq.search.calibration) unless `calibrate` is False. Raises ValueError for knobs the profile cannot
    price."""
    problem = model_problem(profile, knobs)
    if calibrate:
        settings = problem_settings(profile, knobs)
        calibrate_problem(problem, profile, knobs, *settings)
        calibrate_layout(problem, profile, knobs, settings[0])
    return problem


def problem_settings(profile: ProfileData, knobs: ProblemSettings) -> tuple[str, int, int]:
    """(compile mode, micro-batch, accumulation) the knobs run, the profile's where they leave them unset."""
    compile_mode = knobs.compile_mode or profile_compile_mode(profile)
    micro_batch = knobs.micro_batch or int(profile.settings.get("micro_batch", 1) or 1)
    return compile_mode, micro_batch, int(knobs.grad_accum)


__all__ = ["ProblemSettings", "ChoiceProblem", "build_problem", "model_problem", "problem_settings",
           "checkpointing_only", "gradient_modes", "recipe_choice", "recipe_error", "static_bytes_total",
           "state_parts", "compile_modes", "profile_compile_mode", "optimizer_choices", "resolve_optimizer",
           "measured_with", "COMPILE_MODES", "ELEM_BYTES", "EAGER_SPREAD_NOTE", "OVERLAP", "offload_prices"]
