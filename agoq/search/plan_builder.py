"""Turning a solved allocation into a Plan (agoq.formats.plan), with the cost models' predictions filled in."""

from __future__ import annotations

import datetime
from typing import Optional

import numpy as np

from agoq.formats.plan import Alternative, Plan, new_plan
from agoq.formats.profile import ProfileData
from agoq.parallel_dims import ParallelDims, launch_of
from agoq.search.costs import (
    ChoiceProblem,
    ProblemSettings,
    profile_compile_mode,
    resolve_optimizer,
)
from agoq.search.layouts import resolve_layout
from agoq.vocabulary import HSDP
from agoq.search.milp import Allocation
from agoq.search.price import plan_layout
from agoq.search.timing import prices


def now() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def dims_for(stages: int, gradient_mode: str, world_size: int, layout: Optional[str] = None, *,
             node_size: Optional[int] = None) -> ParallelDims:
    """A plan's ranks as dimensions (its `parallel` section, agoq.parallel_dims): pipeline stages are one process
    each; FSDP2 (`layout` fsdp; TLq-HS with sdp4bit gradients) shards over the profile's
    world size; hsdp replicates world / node_size nodes of node_size FSDP2 shards (replicate x shard, fsdp2);
    replicated bf16 and QuanGrad replicate over it (one process or DDP). `layout` None: the gradient
    mode's own (agoq.search.layouts.resolve_layout)."""
    return ParallelDims.of_layout(resolve_layout(layout, gradient_mode), world_size, stages,
                                  ranks_per_node=node_size if layout == HSDP else None)


def launch_for(stages: int, gradient_mode: str, world_size: int, layout: Optional[str] = None, *,
               node_size: Optional[int] = None) -> dict:
    """How a plan must be launched, as derived from its dims (`dims_for`): processes, `agoq train --parallel` mode
    and the command line (MODEL and PLAN.json are placeholders; agoq.parallel_dims.launch_of)."""
    return launch_of(dims_for(stages, gradient_mode, world_size, layout, node_size=node_size), gradient_mode)


def profiled_device(profile) -> Optional[str]:
    """The device a profile was measured on, as a plan's `source.device` names it: the GPU's name, "cpu", or None
    where the profile does not say."""
    hw = profile.header.get("hardware") or {}
    if hw.get("device") == "cpu":
        return "cpu"
    return hw.get("name") or None


def compile_cost(profile: ProfileData, layers: list[dict], compile_mode: str) -> tuple[int, Optional[float]]:
    """(layer graphs a compiled plan compiles, about the seconds a fresh process spends compiling them; None where
    the profile measured no first step of a kind it needs). One graph per distinct layer setting: unmodified,
    checkpointed, or each setting under LAAQ. Priced by agoq.search.timing.StepPrices.compile_seconds: the bf16
    step's price once (the first graph of a process, which also starts Inductor), each setting under LAAQ at the
    agoq-paper step's and the checkpointed graph at the checkpoint-all step's. On the probe (H200) the first step of
    a fresh process took 1.15x to 1.7x this with a cold Inductor cache, 0.35x with a warm one. Eager plans compile
    nothing."""
    if compile_mode != "compiled":
        return 0, 0.0
    laaq, checkpointed, unmodified = set(), False, False
    for lp in layers:
        kinds = {k: v for k, v in (lp.get("kinds") or {}).items() if v != 16}
        if lp.get("checkpoint"):
            checkpointed = True
        elif kinds:
            laaq.add(tuple(sorted(kinds.items(), key=str)))
        else:
            unmodified = True
    sp = prices(profile)
    parts = [sp.compile_seconds("bf16")] + [sp.compile_seconds("agoq-paper")] * len(laaq) \
        + ([sp.compile_seconds("checkpoint-all")] if checkpointed else [])
    seconds = None if any(v is None for v in parts) else float(sum(parts))
    return int(unmodified) + len(laaq) + int(checkpointed), seconds


def alternative_knobs(plan: Plan, alt: Optional[Alternative] = None) -> dict:
    """What alternative `alt` of `plan` (None: `plan.alternative`) runs, as plan data to update the plan's with: its
    layers (every kind at 16, its checkpointed and offloaded layers, the plan's stages), bf16 gradients, its optimizer
    and masters, and its training (batch split, compile mode, torch.compile memory budget)."""
    alt, data = alt or plan.alternative, plan.to_dict()
    return {"layers": [{"layer": lp.layer, "stage": lp.stage, "checkpoint": lp.layer in alt.checkpoint_layers,
                        "kinds": {}, "offload": lp.layer in (alt.offload_layers or [])} for lp in plan.layers],
            "gradients": {**data["gradients"], "mode": "bf16"}, "optimizer": alt.optimizer.model_dump(mode="json"),
            "training": {**data["training"], "micro_batch": alt.micro_batch, "grad_accum": alt.grad_accum,
                         "compile": alt.compile, "activation_memory_budget": alt.activation_memory_budget}}


def plan_of_alternative(plan: Plan, why: str, profile: ProfileData) -> Plan:
    """`plan` rewritten as its best alternative (`plan.alternative`: what a user runs without agoq, as the search
    priced it): every kind at 16, the alternative's checkpointed and offloaded layers, optimizer and masters, batch split,
    compile mode and torch.compile memory budget, bf16 gradients, the plan's pipeline layout (the alternative was
    priced in it; without a peak per stage, each stage is given the largest), its predicted figures (its compile cost from
    `profile`); `why` goes into the decision. The alternatives list stays, and `alternative` becomes the agoq plan
    it replaced."""
    alt = plan.alternative
    data = plan.to_dict()
    stages = int(data["pipeline"]["stages"])  # the alternative keeps the plan's layout (it was priced in it)

    def per_stage(name: str):
        """The alternative's figure `name` per stage, when it has one value per stage (None otherwise)."""
        values = getattr(alt.predicted, name, None)
        return list(values) if values and len(values) == stages else None

    def stage_peaks() -> list[int]:
        """Each stage's peak: the sum of its memory parts where the alternative has them, else the largest stage's."""
        memory = per_stage("memory_per_stage")
        if memory:
            return [int(sum((m["parts"] if isinstance(m, dict) else m.parts).values())) for m in memory]
        return [alt.predicted.peak_bytes] * stages

    replaced = {"name": "agoq: " + ", ".join(f"{k} {v}" for k, v in (data.get("decision") or {}).get("knobs", {}).items()),
                "compile": data["training"]["compile"], "layout": plan_layout(plan) or "replicated", "optimizer": data["optimizer"],
                "gradients": data["gradients"]["mode"], "micro_batch": data["training"]["micro_batch"],
                "grad_accum": data["training"]["grad_accum"], "checkpoint_layers": plan.checkpoint_layers(),
                "predicted": {"step_seconds": plan.predicted.step_seconds,
                              "peak_bytes": max(plan.predicted.peak_bytes_per_stage),
                              "tokens_per_second": (data.get("decision") or {}).get("tokens_per_second")},
                "fits": True, "speedup_predicted": 1.0 / alt.speedup_predicted if alt.speedup_predicted else None}
    data.update(alternative_knobs(plan))
    data.update(
        predicted={"peak_bytes_per_stage": per_stage("peak_bytes_per_stage") or stage_peaks(),
                   "activation_bytes_per_stage": per_stage("activation_bytes_per_stage") or [],
                   **({"memory_per_stage": alt.predicted.memory_per_stage}
                      if getattr(alt.predicted, "memory_per_stage", None) else {}),
                   "step_seconds": alt.predicted.step_seconds, "grad_error": 0.0},
        alternative=replaced)
    data["predicted"]["compile_graphs"], data["predicted"]["compile_seconds"] = compile_cost(
        profile, data["layers"], alt.compile)
    if any(lp["offload"] for lp in data["layers"]):  # what its offloaded layers hold on the host and move
        for name in ("host_bytes", "offload_link_seconds"):
            if getattr(alt.predicted, name, None) is not None:
                data["predicted"][name] = getattr(alt.predicted, name)
    else:
        data.pop("host_budget_bytes", None)
    layout = getattr(alt, "layout", None) or "replicated"  # the alternative's own layout: DDP, FSDP2 or HSDP
    dims = plan.dims()
    world = 1 if dims is None else dims.data_ranks if stages == 1 else dims.world_size
    data["parallel"] = dims_for(stages, "bf16", world, layout, node_size=profile.node_size).to_dict()
    data.pop("launch", None)  # derived from the dims
    decision = dict(data.get("decision") or {})
    knobs = decision.get("knobs", {})
    decision.update(reason=why, agoq=False, tokens_per_second=alt.predicted.tokens_per_second,
                    knobs={**{k: v for k, v in knobs.items() if k != "weight_gather"},
                           **({"layout": layout} if "layout" in knobs else {}),
                           "gradients": "bf16", "optimizer": alt.optimizer.name,
                           "master": alt.optimizer.master, "micro_batch": alt.micro_batch,
                           "grad_accum": alt.grad_accum, "compile": alt.compile})
    data["decision"] = decision
    data["source"] = {**data["source"], "method": "alternative"}
    return Plan.model_validate(data)


def build_plan(profile: ProfileData, problem: ChoiceProblem, alloc: Allocation, knobs: ProblemSettings,
               budget_bytes: Optional[int], method: str, objective: str) -> Plan:
    """A validated Plan for `alloc` (the choice), `knobs` (block, format, micro-batch, gradient mode ...)."""
    settings = alloc.settings(problem)
    layers = [{"layer": l, "stage": int(problem.layer_stage[l]), **settings[l]} for l in range(problem.num_layers)]
    offload = alloc.offloaded() if alloc.offloaded().any() else None
    activation = alloc.activation_bytes_per_stage
    if activation is None:
        activation = problem.evaluate(alloc.chosen, alloc.checkpoint, offload)["activation_bytes_per_stage"]
    s = profile.settings
    optimizer, master = resolve_optimizer(profile, knobs.optimizer, knobs.master)
    data = {
        "parallel": {**dims_for(problem.num_stages, knobs.gradient_mode, profile.world_size, knobs.layout,
                                node_size=profile.node_size).to_dict(),
                     **({"weight_gather": knobs.weight_gather} if knobs.weight_gather != "bf16" else {})},
        "budget_bytes": int(budget_bytes) if budget_bytes is not None else None,
        "activations": {"block": int(knobs.block or s.get("block", 128)), "format": knobs.format,
                        "rounding": "nearest"},
        "gradients": {"mode": knobs.gradient_mode, "block": 256, "bucket_bytes": 25 * 2**20},
        "pipeline": {"stages": problem.num_stages, "micro_batches": int(s.get("micro_batches", 1) or 1),
                     "schedule": knobs.schedule},
        "training": {"micro_batch": int(knobs.micro_batch or s.get("micro_batch", 1) or 1),
                     "seq_len": int(s.get("seq_len", 1) or 1), "grad_accum": int(knobs.grad_accum),
                     "compile": knobs.compile_mode or profile_compile_mode(profile)},
        "optimizer": {"name": optimizer, "master": master},
        "predicted": {"peak_bytes_per_stage": [int(p) for p in alloc.peak_bytes_per_stage],
                      "activation_bytes_per_stage": activation,
                      "memory_per_stage": problem.memory_parts(alloc.chosen, alloc.checkpoint, offload),
                      "step_seconds": float(alloc.step_seconds),
                      "grad_error": float(alloc.grad_error),
                      # errors of several choices add about in quadrature (docs/formats.md); the sum bounds it
                      "grad_error_quadrature": float(np.sqrt(np.sum(problem.error_terms(alloc.chosen) ** 2)))},
        "measured": None,
        "source": {"method": method, "objective": objective, "profile": str(profile.path), "date": now(),
                   "device": profiled_device(profile)},
    }
    data["predicted"]["compile_graphs"], data["predicted"]["compile_seconds"] = compile_cost(
        profile, layers, data["training"]["compile"])
    if offload is not None:  # layers kept in host memory: what they hold there and the link's time
        data["predicted"]["host_bytes"] = int(alloc.host_bytes)
        data["predicted"]["offload_link_seconds"] = float(alloc.offload_link_seconds) * problem.offload.grad_accum
        data["host_budget_bytes"] = int(problem.offload.host_budget_bytes)
    floors = {k: b for k, b in knobs.floor_bits if b > 2}
    if floors:
        data["source"]["floor_bits"] = floors
    if alloc.gap > 1e-4:
        data["source"]["objective_gap"] = alloc.gap
        data["source"].setdefault("notes", []).append(
            f"the MILP stopped at its time limit: this plan's {objective} is the best found, proven within "
            f"{alloc.gap:.2%} of the optimum")
    if alloc.second_gap > 1e-4:
        second = "step time" if objective == "error" else "gradient error"
        data["source"]["second_objective_gap"] = alloc.second_gap
        data["source"].setdefault("notes", []).append(
            f"the {second} among the plans of least {objective} is the best found in a bounded search "
            f"(proven within {alloc.second_gap:.2%})")
    if offload is not None:
        unlike = [what for what, on in (("QuanGrad's gradients", knobs.gradient_mode != "bf16"),
                                         (f"{int(alloc.checkpoint.sum())} checkpointed layer(s)",
                                          bool(alloc.checkpoint.any()))) if on]
        if unlike:  # the offloading step the price comes from had neither: the host work they add is not in it
            data["source"].setdefault("notes", []).append(
                f"offload is priced from the profile's offloading step, which ran bf16 gradients and no "
                f"checkpointed layer; this plan adds {' and '.join(unlike)}, whose host work a step at a small "
                f"micro-batch may not hide (on an H100, the probe's compiled plan at 1 x 2 with both, 8 layers "
                f"offloaded, ran 165.6 ms where 138.5 was predicted; kept on the GPU it ran 141.9): measure it "
                f"with agoq train --plan, and agoq search --runs RUN_DIR prices the next search from it")
    if problem.notes:
        data["source"]["notes"] = data["source"].get("notes", []) + list(problem.notes)
    return new_plan({"name": profile.model_name, "fingerprint": profile.fingerprint}, layers, "the searched plan",
                    **data)
