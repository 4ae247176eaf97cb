"""agoq's search: cost models from a Profile, the exact per-layer choice (MILP), the Optuna study over the
knobs it cannot add up, Pareto fronts and validation of plans by real runs.

`plan_from_profile(profile_dir, budget)` gives the MILP's plan; `search(profile, request)` runs the whole search
(agoq.search.search) for a SearchRequest (agoq.search.request), as `agoq search` and the dashboard's plan service
do.
"""

from agoq.search.request import InfeasibleBudget, SearchRequest
from agoq.search.search import plan_from_profile, search

__all__ = ["plan_from_profile", "search", "SearchRequest", "InfeasibleBudget"]
