"""agoq's search: cost models from a Profile, the exact per-layer choice (MILP), the Optuna study over the
knobs it cannot add up, Pareto fronts and validation of plans by real runs.

`plan_from_profile(profile_dir, budget)` gives the MILP's plan; `search(...)` runs the whole search
(agoq.search.search) that `agoq search` drives.
"""

from agoq.search.search import plan_from_profile, search

__all__ = ["plan_from_profile", "search"]
