"""agoq's search: cost models from a Profile, the exact per-layer choice (MILP), the Optuna study over the
knobs it cannot add up, Pareto fronts and validation of plans by real runs.

`plan_from_profile(profile_dir, budget)` gives the MILP's plan; `search(profile, request)` runs the whole search
(agoq.search.search) for a SearchRequest (agoq.search.request), as `agoq search` and the dashboard's plan service
do. The names load on first use, so that reading a request (agoq.search.request) imports no cost model.
"""

from importlib import import_module

_HOMES = {"plan_from_profile": "agoq.search.search", "search": "agoq.search.search",
          "SearchRequest": "agoq.search.request", "InfeasibleBudget": "agoq.search.request"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'agoq.search' has no attribute {name!r}")
