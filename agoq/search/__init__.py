"""agoq's search: cost models from a Profile, the exact per-layer choice (MILP), the Optuna study over the
knobs it cannot add up, Pareto fronts and validation of plans by real runs."""

from agoq.search.orchestrate import plan_from_profile, search

__all__ = ["plan_from_profile", "search"]
