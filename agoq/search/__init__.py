"""agoq's search: cost models from a Profile, the exact per-layer choice (MILP), the Optuna study over the
knobs it cannot add up, Pareto fronts and validation of plans by real runs.

`plan_from_profile` and `search` (agoq.search.orchestrate) are imported on first use, so that
`agoq.search.validation` (torch only) works where pandas, scipy or pydantic are missing; without them,
importing those two names raises ImportError.
"""

from __future__ import annotations

__all__ = ["plan_from_profile", "search"]


def __getattr__(name: str):
    if name in __all__:
        from agoq.search import orchestrate

        return getattr(orchestrate, name)
    raise AttributeError(f"module 'agoq.search' has no attribute {name!r}")
