"""What-if plans over world sizes: for each size and data-parallel layout, the plan `agoq search --world-size N`
would write (agoq.search.whatif), as one row of figures. The dashboard's what-if page and
experiments/whatif_papers.py read these rows.

A row: {world_size, node_size, layout, gradients, found, tokens_per_second (the cluster's: per rank x data ranks),
tokens_per_second_per_rank, step_seconds, peak_bytes (per rank), knobs, reason (why no plan,
where none)}.
"""

from __future__ import annotations

from typing import Optional

from agoq.formats.profile import ProfileData
from agoq.search.network import Network
from agoq.search.request import InfeasibleBudget, SearchRequest, knob_space
from agoq.search.whatif import retarget
from agoq.vocabulary import HSDP, LAYOUTS


def plan_row(profile: ProfileData, world: int, node_size: int, network: Optional[Network | str], budget: int,
             layout: str, gradients: str = "any") -> dict:
    """The what-if plan's figures at `world` ranks for one layout (and gradient mode; "any": the search's choice)."""
    from agoq.search.search import search

    row = {"world_size": world, "node_size": min(node_size, world), "layout": layout, "gradients": gradients,
           "found": False}
    try:
        target, _ = retarget(profile, world, min(node_size, world), network)
        request = SearchRequest(budget, space=knob_space(layout=layout, gradients=gradients), front_budgets=0)
        plan = search(target, request, progress=False, alternatives=False).plan
    except (InfeasibleBudget, ValueError) as e:
        return {**row, "reason": str(e).splitlines()[0][:300]}
    dims, d = plan.dims(), plan.decision
    ranks = dims.data_ranks if dims is not None else world
    per_rank = float(d.tokens_per_second) if d is not None else 0.0
    return {**row, "found": True, "gradients": plan.gradients.mode, "tokens_per_second": per_rank * ranks,
            "tokens_per_second_per_rank": per_rank, "step_seconds": float(plan.predicted.step_seconds),
            "peak_bytes": int(max(plan.predicted.peak_bytes_per_stage)),
            "knobs": dict(d.knobs) if d is not None else {}}


def sweep(profile: ProfileData, worlds: list[int], node_size: int, network: Optional[Network | str], budget: int,
          layouts: tuple = LAYOUTS) -> list[dict]:
    """`plan_row` for every world size and layout (a world of one rank has the replicated layout only; hsdp only
    where the world spans nodes, more ranks than `node_size`)."""
    rows = []
    for world in worlds:
        for layout in layouts:
            if (world == 1 and layout != "replicated") or (layout == HSDP and world <= node_size):
                continue
            rows.append(plan_row(profile, world, node_size, network, budget, layout))
    return rows


__all__ = ["plan_row", "sweep"]
