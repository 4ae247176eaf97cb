"""A profile re-targeted to clusters it was not measured on (agoq.search.whatif): for world sizes 2..max_world and
each data-parallel layout, the plan `agoq search --world-size N --node-size G --network SPEC` would write
(agoq.search.whatif_sweep), as the what-if page and /api/whatif show it: the cluster's tokens/s and the memory per
rank against the world size, one line per layout, and the plan at each size.

Searches are cached per (profile folder and its files' times and sizes, network, node size, budget, largest world):
the page can be reloaded without searching again.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from agoq.units import format_bytes, parse_size
from agoq.vocabulary import LAYOUTS
from dashboard.figures import PALETTE, _figure
from dashboard.markup import Page, esc, fmt_num, link, message, table

MAX_WORLD = 4096
DEFAULT_MAX_WORLD = 1024


def worlds_up_to(max_world: int) -> list[int]:
    """2, 4, 8, ... up to `max_world` (and it, where it is not a power of two)."""
    out, n = [], 2
    while n <= max_world:
        out.append(n)
        n *= 2
    if max_world >= 2 and out[-1] != max_world:
        out.append(max_world)
    return out


def read_settings(network: Optional[str], node_size: Optional[int], budget: Optional[str], max_world: int,
                  memory_bytes: Optional[int]) -> dict[str, Any]:
    """The page's settings checked; ValueError saying which is wrong and what to give."""
    from agoq.search.network_spec import parse_network

    if network:
        parse_network(network)  # refuses an unknown preset or bad figures, in its words
    if node_size is not None and node_size < 1:
        raise ValueError(f"node_size must be >= 1, got {node_size}")
    if not 2 <= max_world <= MAX_WORLD:
        raise ValueError(f"max_world must be from 2 to {MAX_WORLD}, got {max_world}")
    if budget:
        try:
            budget_bytes = parse_size(budget)
        except ValueError as e:
            raise ValueError(f"budget: {e}") from None
    elif memory_bytes:
        budget_bytes = int(memory_bytes)
    else:
        raise ValueError("the profile names no GPU memory: give budget (bytes per GPU, e.g. 80GB)")
    if budget_bytes <= 0:
        raise ValueError("budget must be more than 0 bytes")
    return {"network": network or None, "node_size": node_size, "budget": budget_bytes, "max_world": max_world}


def _signature(folder: Path) -> tuple:
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir() if p.is_file()))


@lru_cache(maxsize=16)
def _sweep(folder: str, signature: tuple, network: Optional[str], node_size: Optional[int], budget: int,
           max_world: int) -> dict[str, Any]:
    from agoq.formats.profile import load_profile
    from agoq.search.whatif import default_node_size, retarget
    from agoq.search.whatif_sweep import sweep

    profile = load_profile(folder)
    worlds = worlds_up_to(max_world)
    g = node_size or default_node_size(profile, max_world)
    _, whatif = retarget(profile, g * max(1, max_world // g), g, network)  # the network and its fit, said once
    rows = sweep(profile, worlds, g, network, budget, LAYOUTS)
    return {"measured_world_size": profile.world_size, "node_size": g, "budget_bytes": budget, "worlds": worlds,
            "network": {"name": whatif.network.name, "source": whatif.network.source,
                        "described": whatif.network.describe()},
            "fit": None if whatif.fit is None else {**whatif.fit.summary(), "lines": whatif.fit.lines()},
            "check_first": whatif.check_command(whatif.model_spec), "rows": rows}


def whatif(folder: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The what-if of the profile in `folder` under the page's `settings` (read_settings)."""
    return _sweep(str(folder), _signature(folder), settings["network"], settings["node_size"], settings["budget"],
                  settings["max_world"])


def _lines(rows: list[dict[str, Any]], value: str, scale: float) -> list[dict[str, Any]]:
    data = []
    for i, layout in enumerate(LAYOUTS):
        mine = [r for r in rows if r["layout"] == layout]
        if not any(r["found"] for r in mine):
            continue
        data.append({"type": "scatter", "mode": "lines+markers", "name": layout,
                     "x": [r["world_size"] for r in mine],
                     "y": [r[value] / scale if r["found"] else None for r in mine],
                     "line": {"color": PALETTE[i % len(PALETTE)]}})
    return data


def figures(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Tokens/s of the cluster and peak memory per rank against the world size, one line per layout."""
    rows = data["rows"]
    axis = {"title": {"text": "world size (ranks)"}, "type": "log"}
    return [_figure(_lines(rows, "tokens_per_second", 1.0), "tokens/s of the cluster", xaxis=axis,
                    yaxis={"title": {"text": "tokens/s"}, "type": "log"}),
            _figure(_lines(rows, "peak_bytes", 2**30), "predicted peak memory per rank", xaxis=axis,
                    yaxis={"title": {"text": "GiB"}})]


def page(profile_id: str, data: dict[str, Any], settings: dict[str, Any]) -> str:
    """The what-if page: its settings form, the network and its fit, the two charts and the plan at each size."""
    shown = Page(f"what-if {profile_id}")
    shown.add(message(f"Not measured: planned for clusters of up to {settings['max_world']} ranks from a profile of "
                      f"{data['measured_world_size']}. Compute per rank is the profile's measured steps; every "
                      "collective comes from a latency-bandwidth model; memory per rank from the layout. Run first, "
                      f"on one node of the real cluster: {data['check_first']}", "warn"))
    form = (f'<form method=get action="/whatif"><input type=hidden name=id value="{esc(profile_id)}">'
            f'<label>network <input name=network value="{esc(settings["network"] or "")}" '
            'placeholder="profile (fitted), a preset or intra=GBps@us,inter=GBps@us"></label> '
            f'<label>node size <input name=node_size type=number min=1 value="{esc(data["node_size"])}"></label> '
            f'<label>budget <input name=budget value="{esc(format_bytes(data["budget_bytes"]))}"></label> '
            f'<label>largest world <input name=max_world type=number min=2 max={MAX_WORLD} '
            f'value="{esc(settings["max_world"])}"></label> <button>plan</button></form>')
    shown.add(form)
    shown.add(f"<p>network: {esc(data['network']['described'])}</p>")
    if data["fit"] is not None:
        shown.add("<pre>" + esc("\n".join(data["fit"]["lines"])) + "</pre>")
    for fig in figures(data):
        shown.figure(fig)
    cells = []
    for r in data["rows"]:
        if not r["found"]:
            cells.append([fmt_num(r["world_size"]), esc(r["layout"]), "", "", "", "",
                          f'<span class="bad">{esc(r.get("reason", "no plan"))}</span>'])
            continue
        k = r["knobs"]
        knobs = (f"{k.get('optimizer')}, micro-batch {k.get('micro_batch')} x {k.get('grad_accum')}, "
                 f"{k.get('compile')}" + (f", {k['weight_gather']} weight gather" if k.get("weight_gather") else ""))
        cells.append([fmt_num(r["world_size"]), esc(r["layout"]), esc(r["gradients"]),
                      f"{r['tokens_per_second']:,.0f}", f"{r['step_seconds'] * 1e3:.1f} ms",
                      esc(format_bytes(r["peak_bytes"])), esc(knobs)])
    shown.add("<h2>The plan at each size</h2>")
    shown.add(table(["ranks", "layout", "gradients", "tokens/s", "step", "peak per rank", "plan"], cells))
    shown.add(f'<p><a href="{esc(link("/profile", id=profile_id))}">back to the profile</a></p>')
    return shown.render()


__all__ = ["whatif", "page", "figures", "read_settings", "worlds_up_to", "MAX_WORLD", "DEFAULT_MAX_WORLD"]
