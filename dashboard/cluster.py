"""A plan over several ranks as the plan page shows it: its layout as dimensions (replicate x shard x pipeline,
ranks per node, what shards the state, FSDP2's weight gather, the gradients' wire format, the data ranks a step's
tokens count) and the layout steps its profile measured on several ranks beside the search's prices of them.

`layout(plan)` reads the plan's `parallel` section as written (a plan before it: its `launch`, through
agoq.parallel_dims.plan_dims), so that it counts data ranks = replicate x shard for every layout: one process,
DDP (replicate N), FSDP2 (shard N) and HSDP (replicate R x shard S, FSDP2 with replicas).

`layout_steps(folder, header)` prices each layout step (profile.json `layout_steps`, read by
agoq.formats.views.layout_steps) at its own configuration by the one price (agoq.search.price): the model before
the layout calibration (the profile without its layout steps) and calibrated on them (agoq.search.layout_calibration:
exposed communication = the measured step less the priced compute; the peak moved by the measured margin). Cached
per profile folder until its files change.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from agoq.files import json_safe
from agoq.formats import views
from agoq.parallel_dims import plan_dims
from dashboard.formats import format_bytes, number
from dashboard.markup import esc, fmt_num, fmt_seconds, message, table

# the gradients' wire format per (parallel mode, gradient mode), as agoq.search.network and agoq.runtime.comm send
WIRE = {
    ("ddp", "bf16"): "bf16 all-reduce (NCCL), 2 bytes per value",
    ("ddp", "quangrad8"): "QuanGrad all-reduce: int8 codes + a float32 scale per 256 values (all-to-all, then "
                          "all-gather), 1.016 bytes per value",
    ("fsdp", "bf16"): "bf16 reduce-scatter (NCCL), 2 bytes per value",
    ("fsdp", "sdp4bit"): "TLq-HS reduce-scatter: int8 inside a node, int4 across nodes (a float32 scale per 128)",
    ("hsdp", "bf16"): "bf16 reduce-scatter inside a node, bf16 all-reduce of the shards across nodes (FSDP2's own, "
                      "once per step)",
    ("hsdp", "quangrad8"): "float32 reduce-scatter inside a node, QuanGrad's 8-bit all-reduce of the shards across "
                           "nodes",
    ("hsdp", "sdp4bit"): "TLq-HS int8 reduce-scatter inside a node, TLq's 4-bit all-reduce of the shards across "
                         "nodes (a float32 scale per 128)",
}
RETIRED = "sharded (retired: agoq train refuses it; run --parallel fsdp --gradients sdp4bit --weight-gather int4)"
GATHER = {"bf16": "bf16 (FSDP2's own), 2 bytes per value",
          "int8": "int8 block codes + a float32 scale per 256 values, 1.016 bytes per value",
          "int4": "int4 block codes + a float32 scale per 256 values, 0.516 bytes per value"}


def _count(section: dict[str, Any], name: str) -> int:
    value = section.get(name, 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def mode_of(replicate: int, shard: int, pipeline: int, engine: Optional[str]) -> str:
    """The runtime's parallel mode of these dimensions: pipeline, hsdp (FSDP2 with replicas), fsdp, ddp (replicas),
    none (one process); a plan of agoq's retired own sharded step (engine sdp4bit) says so, as agoq train refuses it."""
    if pipeline > 1:
        return "pipeline"
    if engine == "fsdp2":
        return "hsdp" if replicate > 1 else "fsdp"
    if engine == "sdp4bit":
        return RETIRED
    return "ddp" if replicate * shard > 1 else "none"


def layout(plan: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The plan's layout as dimensions (see the module docstring); None for a plan that says none (schema 1.0)."""
    section = plan.get("parallel")
    if not isinstance(section, dict):
        try:
            dims = plan_dims(plan)
        except ValueError:
            dims = None
        if dims is None:
            return None
        section = dims.to_dict()
    replicate, shard, pipeline, tensor = (_count(section, k) for k in ("replicate", "shard", "pipeline", "tensor"))
    engine = section.get("engine")
    mode = mode_of(replicate, shard, pipeline, engine)
    world = replicate * shard * pipeline * tensor
    per_node = number(section.get("ranks_per_node"))
    gradients = (plan.get("gradients") or {}).get("mode") or "bf16"
    if mode in ("none", "pipeline"):
        wire = "none: one replica (no gradient collective)"
    else:
        wire = WIRE.get((mode, gradients), f"{gradients} ({mode})")
    gather = section.get("weight_gather") or "bf16"
    whatif = plan.get("whatif") if isinstance(plan.get("whatif"), dict) else None
    return json_safe({
        "replicate": replicate, "shard": shard, "pipeline": pipeline, "tensor": tensor, "world_size": world,
        "data_ranks": replicate * shard, "ranks_per_node": int(per_node) if per_node else None,
        "nodes": world // int(per_node) if per_node and world % int(per_node) == 0 else None,
        "engine": engine, "mode": mode, "gradients": gradients, "gradients_wire": wire,
        "weight_gather": GATHER.get(gather, gather) if engine == "fsdp2" else None,
        "gather": gather if engine == "fsdp2" else None,
        "launch": (whatif or {}).get("launch") or (plan.get("launch") or {}).get("command"),
        "whatif": None if whatif is None else {k: whatif.get(k) for k in ("measured_world_size", "world_size",
                                                                          "node_size", "nodes")}})


def is_cluster(plan_layout: Optional[dict[str, Any]], profile_header: Optional[dict[str, Any]]) -> bool:
    """Whether the plan (or the profile it was made from) spans several ranks."""
    world = int(((profile_header or {}).get("settings") or {}).get("world_size") or 1)
    return bool(plan_layout and plan_layout["world_size"] > 1) or world > 1


def _signature(folder: Path) -> tuple:
    return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir() if p.is_file()))


@lru_cache(maxsize=16)
def _priced(folder: str, signature: tuple) -> tuple:
    from agoq.formats.profile import load_profile
    from agoq.search.layout_calibration import row_knobs
    from agoq.search.price import Configuration, price

    profile = load_profile(folder)
    header = {k: v for k, v in profile.header.items() if k != "layout_steps"}
    model = dataclasses.replace(profile, header=header, cache={})  # the same profile, no layout calibration
    out = []
    for row in views.layout_steps(profile.header):
        config = Configuration(row_knobs(profile, row))
        try:
            before, after = price(model, config), price(profile, config)
        except ValueError as e:
            out.append({"error": str(e).splitlines()[0][:300]})
            continue
        out.append({"model_step_seconds": before.step_seconds,
                    "model_communication_seconds": before.communication_seconds,
                    "model_peak_bytes": before.peak_bytes,
                    "calibrated_step_seconds": after.step_seconds,
                    "calibrated_communication_seconds": after.communication_seconds,
                    "calibrated_peak_bytes": after.peak_bytes})
    return tuple(out)


KEEP = ("layout", "gradients", "weight_gather", "compile", "micro_batch", "grad_accum", "optimizer", "master",
        "steps", "step_seconds", "peak_bytes")


def layout_steps(folder: Path, header: dict[str, Any], plan_layout: Optional[dict[str, Any]] = None) -> dict:
    """{world_size, rows}: each layout step the profile measured (its configuration, measured step and peak) with
    its prices (module docstring) and whether it is the plan's own layout (`mine`); rows [] where the profile
    measured none."""
    rows = views.layout_steps(header)
    section = header.get("layout_steps") or {}
    if not rows:
        return {"world_size": section.get("world_size"), "rows": []}
    if section.get("world_size") == 1:  # one process running FSDP2: a what-if's anchor, no price on one rank
        return json_safe({"world_size": 1, "rows": [{**{k: r.get(k) for k in KEEP}, "mine": False} for r in rows]})
    priced = _priced(str(folder), _signature(folder))
    mine = None
    if plan_layout is not None:
        word = {"ddp": "replicated", "fsdp": "fsdp"}.get(plan_layout["mode"])
        mine = (word, plan_layout["gradients"], plan_layout["gather"] or "bf16")
    out = [{**{k: r.get(k) for k in KEEP}, **p, "mine": mine == (r["layout"], r["gradients"], r["weight_gather"])}
           for r, p in zip(rows, priced)]
    return json_safe({"world_size": section.get("world_size"), "rows": out})


def layout_cell(plan_layout: Optional[dict[str, Any]]) -> str:
    """A plan's layout in a few words, as the overview lists it: "fsdp · 8 ranks, 8 data" ("–": none said)."""
    if not plan_layout:
        return "–"
    word = f"{plan_layout['mode']} · {plan_layout['world_size']} rank(s), {plan_layout['data_ranks']} data"
    if plan_layout.get("nodes"):
        word += f", {plan_layout['nodes']} node(s) of {plan_layout['ranks_per_node']}"
    return word


def render(data: Optional[dict[str, Any]]) -> str:
    """The plan page's cluster sections (HTML) of `Dashboard._cluster`'s data; "" for a plan of one rank."""
    if not data:
        return ""
    out = ["<h2>Layout</h2>"]
    lay = data["layout"]
    if lay is None:
        out.append(message("This plan says nothing of its ranks (a plan before schema agoq.plan/1.8).", "info"))
    else:
        dims = f"{lay['replicate']} x {lay['shard']} x {lay['pipeline']}"
        out.append(table(["ranks", "data ranks", "replicate x shard x pipeline", "ranks per node", "engine",
                          "weight gather", "gradients on the wire", "runs as"],
                         [[fmt_num(lay["world_size"]), fmt_num(lay["data_ranks"]), esc(dims),
                           fmt_num(lay["ranks_per_node"]) if lay["ranks_per_node"] else "– (torchrun's local ranks)",
                           esc(lay["engine"] or "none (replicated)"), esc(lay["weight_gather"] or "–"),
                           esc(lay["gradients_wire"]), esc(lay["mode"])]]))
        if lay.get("launch"):
            out.append(f"<p>launch: <code>{esc(lay['launch'])}</code></p>")
        w = lay.get("whatif")
        if w:
            out.append(message(f"A what-if plan: made for {w['world_size']} ranks ({w['nodes']} node(s) of "
                               f"{w['node_size']}) from a profile measured on {w['measured_world_size']}; its "
                               "communication is the network model's, not a measurement.", "warn"))
    out.append(render_steps(data["layout_steps"]))
    return "".join(out)


def render_steps(steps: dict[str, Any]) -> str:
    """The layout steps section (HTML) of `layout_steps`' data (with its `profile` id), or its error."""
    out = ["<h2>Layout steps</h2>"]
    if "error" in steps or "empty" in steps:
        out.append(message(steps.get("error") or steps.get("empty"), "error" if "error" in steps else "empty"))
        return "".join(out)
    if not steps["rows"]:
        out.append(message(f"The profile {steps.get('profile')} measured no layout steps (agoq profile under "
                           "torchrun, or with --world-size N, measures a real step of each layout): each layout is "
                           "priced by the model alone.", "empty"))
        return "".join(out)
    if steps["world_size"] == 1:
        out.append("<p class=meta>One process running FSDP2 (profile " + esc(steps.get("profile")) + "): FSDP2's own "
                   "cost per step (its copies and hooks, the quantized gathers' kernels), which a what-if plan for "
                   "several ranks carries (agoq search --world-size N); a plan on one rank does not shard.</p>")
        out.append(table(["layout", "compile", "micro-batch", "measured step", "measured peak"], [
            [esc(f"{r['layout']} ({r['gradients']}" + (f", {r['weight_gather']} gather" if r["weight_gather"] != "bf16"
                                                        else "") + ")"), esc(r["compile"]), fmt_num(r["micro_batch"]),
             fmt_seconds(r["step_seconds"]), format_bytes(r["peak_bytes"])] for r in steps["rows"]]))
        return "".join(out)
    out.append(f"<p class=meta>A real step of each layout on every one of the profile's {fmt_num(steps['world_size'])} "
               f"ranks (profile {esc(steps.get('profile'))}), beside the search's price of the same configuration: "
               "the model's, and calibrated on the step (exposed communication = the measured step less the priced "
               "compute; the peak moved by what the model missed). Marked: the plan's layout.</p>")
    rows = []
    for r in steps["rows"]:
        name = f"{r['layout']} ({r['gradients']}" + (f", {r['weight_gather']} gather" if r["weight_gather"] != "bf16"
                                                   else "") + ")"
        rows.append([("<b>" + esc(name) + "</b> ◀" if r["mine"] else esc(name)), esc(r["compile"]),
                     fmt_num(r["micro_batch"]), fmt_seconds(r["step_seconds"]),
                     fmt_seconds(r.get("calibrated_step_seconds")), fmt_seconds(r.get("model_step_seconds")),
                     fmt_seconds(r.get("calibrated_communication_seconds")),
                     fmt_seconds(r.get("model_communication_seconds")), format_bytes(r["peak_bytes"]),
                     format_bytes(r.get("calibrated_peak_bytes")), format_bytes(r.get("model_peak_bytes"))]
                    + ([f'<span class=bad>{esc(r["error"])}</span>'] if r.get("error") else [""]))
    out.append(table(["layout", "compile", "micro-batch", "measured step", "calibrated step", "model's step",
                      "exposed communication (calibrated)", "model's communication", "measured peak",
                      "calibrated peak", "model's peak", ""], rows))
    return "".join(out)


__all__ = ["layout", "layout_steps", "is_cluster", "mode_of", "layout_cell", "render", "render_steps", "WIRE",
           "GATHER"]
