"""The calibrated cost model: `build_problem` is the ChoiceProblem of a profile under some knobs
(agoq.search.cost_model: memory, step time and gradient error of every per-layer choice) calibrated on the profile's
measured peaks and steps (agoq.search.calibration) and, over several ranks, on its layout steps
(agoq.search.layout_calibration: each layout's exposed communication and peak per rank). The search, the one price (agoq.search.price) and the dashboard
build their problems here.
"""

from __future__ import annotations

import copy
import threading

from agoq.formats.measured_steps import COMPILE_MODES
from agoq.formats.profile import ProfileData
from agoq.search.calibration import calibrate_problem
from agoq.search.layout_calibration import calibrate_layout
from agoq.search.cost_model import ELEM_BYTES, gradient_modes, model_problem
from agoq.search.offload_prices import OVERLAP, offload_prices
from agoq.search.problem import (
    ChoiceProblem,
    ProblemSettings,
    checkpointing_only,
    read_only,
    recipe_choice,
    recipe_error,
)
from agoq.search.state import (
    measured_with,
    optimizer_choices,
    resolve_optimizer,
    state_parts,
    static_bytes_total,
)
from agoq.search.timing import EAGER_SPREAD_NOTE, compile_modes, profile_compile_mode


KEEP_PROBLEMS = 64  # problems a profile keeps, the last built (a request on the probe's profiles builds about 25;
#                    requests that fix other knobs, e.g. a host budget, build others), 0.3 MB each with their rows
_EVICTING = threading.Lock()


def build_problem(profile: ProfileData, knobs: ProblemSettings = ProblemSettings(), *,
                  calibrate: bool = True) -> ChoiceProblem:
    """The ChoiceProblem of a profile under `knobs` (agoq.search.cost_model), calibrated on the profile's measured
    peaks (agoq.search.calibration) unless `calibrate` is False. Raises ValueError for knobs the profile cannot
    price.

    Built once per profile, knobs and `calibrate`, and kept in the profile's cache: one search asks for the same
    knobs several times (the plan, its alternatives, its binding constraints), and the plan service's profiles live
    across requests (0.28 s of a request on the probe's profiles was building problems). Every caller gets the same
    object, its arrays read-only: a caller that needs a changed problem makes its own (dataclasses.replace)."""
    built = profile.cache.setdefault("problems", {})
    key = (knobs, calibrate)
    kept = built.get(key)
    if kept is None:
        try:
            kept = _build_problem(profile, knobs, calibrate)
            read_only(vars(kept))  # shared by every caller
        except ValueError as e:
            kept = e
        with _EVICTING:  # the plan service's threads share its profiles
            built[key] = kept
            while len(built) > KEEP_PROBLEMS:
                built.pop(next(iter(built)))
    if isinstance(kept, ValueError):
        raise copy.copy(kept)  # a fresh exception each time (one raised twice would carry both tracebacks)
    return kept


def _build_problem(profile: ProfileData, knobs: ProblemSettings, calibrate: bool) -> ChoiceProblem:
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
