"""The outer knobs around the per-layer MILP: gradient storage, data-parallel layout (replicated, or FSDP2 where the
profile has several ranks, and HSDP where they span nodes: agoq.search.layouts), optimizer and masters, micro-batch x
accumulation, compile mode. Each combination is one ChoiceProblem, solved exactly by the MILP; the best is kept.

The sequences per optimizer step (global batch G = micro_batch x grad_accum) stay what the profile measured
(or what the caller fixes), so every split trains the same tokens per step and "most tokens/s" is "least step
seconds":

    tokens/s = micro_batch x grad_accum x seq_len / step seconds

Two splits differ in memory (a smaller micro-batch keeps fewer activations) and in time as the profile measured
them: a split is offered only where the profile measured steps at it (agoq.search.timing), and ties go to the
larger micro-batch.

Combinations are pruned only where exactly dominated: two combinations of the same split and compile mode build
the same per-layer options, so one whose static bytes, optimizer-step floor and base step seconds are all no
smaller than another's cannot have a better MILP optimum (brute force over a tiny profile checks this, tests).
The others are bounded: each one's linear relaxation (milliseconds) is a lower bound on its MILP optimum, so they
are solved best bound first and one whose bound is already worse than the best optimum found is not solved at all
(it can neither win nor tie). Near the smallest budget, under an error cap, that skips most MILPs (seconds each);
the answer is the one solving every combination gives (tests).

Objectives: "time" (default) — the most tokens/s, ties by error; "error" — the least gradient error, ties by
tokens/s. The binding constraint of the chosen plan is found by relaxing one constraint at a time: the memory
budget binds when the same knobs without a budget would be faster (or, for "error", more exact), the error cap
when the same knobs without it would be faster, else "none".
"""

from __future__ import annotations

import heapq
import math
import os
from concurrent.futures import wait
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from agoq.formats.profile import ProfileData
from agoq.search.costs import (
    ChoiceProblem,
    ProblemSettings,
    build_problem,
    compile_modes,
    gradient_modes,
    optimizer_choices,
    profile_compile_mode,
    resolve_optimizer,
)
from agoq.search.highs import lp_pool, quiet_stdout, side_pool
from agoq.search.hsdp import hsdp_refusal
from agoq.search.layouts import layouts, resolve_layout
from agoq.search.milp import Allocation, Solver, resolve_time_cap
from agoq.search.milp_model import FIRST_GAP
from agoq.search.request import MASTER_CHOICES, InfeasibleBudget, KnobSpace
from agoq.units import format_bytes_apart
from agoq.vocabulary import FSDP2_LAYOUTS, HSDP


@dataclass
class KnobResult:
    """One solved combination: its knobs, problem, allocation (None: nothing fits) and tokens per second."""

    knobs: ProblemSettings
    problem: Optional[ChoiceProblem] = None
    alloc: Optional[Allocation] = None
    tokens_per_second: float = 0.0
    error: Optional[str] = None
    time_cap: Optional[float] = None   # the cap in seconds it was solved under
    solver: Optional[Solver] = field(default=None, repr=False, compare=False)  # keeps what it solved for reuse

    def key(self, objective: str) -> tuple:
        """Sort key, smaller is better."""
        a = self.alloc
        mb = self.knobs.micro_batch or 0
        if objective == "error":
            return (a.grad_error, -self.tokens_per_second, -mb)
        return (-self.tokens_per_second, a.grad_error, -mb)


@dataclass
class KnobSearch:
    """The best combination, every combination tried, and the binding constraint of the best."""

    best: KnobResult
    tried: list = field(default_factory=list)
    binding: list = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def combinations(profile: ProfileData, space: KnobSpace = KnobSpace(),
                 base: ProblemSettings = ProblemSettings()) -> list[ProblemSettings]:
    """Every ProblemSettings of `space` (other fields from `base`), in a fixed order."""
    modes = [m for m in gradient_modes(profile) if space.gradient_modes is None or m in space.gradient_modes]
    compiles = [m for m in compile_modes(profile) if space.compile_modes is None or m in space.compile_modes]
    if not modes:
        raise ValueError(f"no gradient storage of {space.gradient_modes} has figures in the profile "
                         f"(it has {', '.join(gradient_modes(profile))})")
    if not compiles:
        raise ValueError(f"the profile has step times for compile mode(s) {', '.join(compile_modes(profile))}, not "
                         f"{', '.join(space.compile_modes or ())}")
    world, node = profile.world_size, profile.node_size
    stages = len(set(base.layer_stage)) if base.layer_stage is not None else max(profile.layer_stage()) + 1
    profiled = int(profile.settings.get("micro_batch", 1) or 1)
    batch = int(space.global_batch or profiled)
    sizes = list(space.micro_batches or _divisors(batch))
    bad = [m for m in sizes if m < 1 or batch % m]
    if bad:
        raise ValueError(f"micro-batch sizes {bad} do not divide the global batch of {batch} sequences")
    if profile.model_config() is None:
        sizes = [profiled] if batch % profiled == 0 else []
        if not sizes:
            raise ValueError("the profile has no model config: only its own micro-batch can be planned")
    out = []
    for compile_mode in compiles:
        for mb in sorted(sizes, reverse=True):
            for mode in modes:
                for layout in layouts(world, profile.collectives, mode, stages, node_size=node):
                    if space.layouts is not None and layout not in space.layouts:
                        continue
                    for optimizer, master in optimizer_choices(mode, layout):
                        if space.optimizers is not None and optimizer not in space.optimizers:
                            continue
                        if master not in space.masters:
                            continue
                        for gather in weight_gathers(layout, mode):
                            out.append(replace(base, gradient_mode=mode, layout=layout, optimizer=optimizer,
                                               master=master, compile_mode=compile_mode, micro_batch=mb,
                                               grad_accum=batch // mb, allow_offload=space.offload,
                                               host_budget=space.host_budget,
                                               quantize_attention=space.quantize_attention, weight_gather=gather))
    if not out and not any(layouts(world, profile.collectives, mode, stages, node_size=node) for mode in modes):
        raise ValueError(f"gradient mode(s) {', '.join(modes)} have no layout on this profile: sdp4bit runs under "
                         "FSDP2 (layout fsdp), which needs a profile of several ranks, one pipeline stage and the "
                         "all-gather and reduce-scatter timings of its collectives table")
    if not out and space.layouts is not None:
        offered = sorted({lay for mode in modes
                          for lay in layouts(world, profile.collectives, mode, stages, node_size=node)})
        reasons = [hsdp_refusal(world, node, profile.collectives, mode, stages) for mode in modes] \
            if HSDP in space.layouts else []
        why = "; ".join(dict.fromkeys(r for r in reasons if r))
        raise ValueError(f"no layout of {', '.join(space.layouts)} is possible with this profile (it offers "
                         f"{', '.join(offered)}; fsdp needs several ranks, one pipeline stage and the all-gather "
                         "and reduce-scatter timings of its collectives table"
                         + (f"; hsdp is not offered: {why}" if why else "") + ")")
    if not out:
        raise ValueError("no optimizer/master combination of the knob space is allowed (masters 'none' needs "
                         "adamw8bit)")
    return out


def weight_gathers(layout: str, gradient_mode: str) -> tuple:
    """FSDP2's weight all-gathers a combination may take (fsdp; hsdp, within the node): with agoq's TLq-HS
    gradients (sdp4bit) also agoq's int8 and int4 ones (`agoq train --weight-gather int8 / int4`,
    agoq.runtime.comm.fsdp_weight_gather), agoq's quantized collectives at once (what replaced its own sharded
    step); otherwise FSDP2's own bf16 gather (and every other layout gathers no weights)."""
    return ("bf16", "int8", "int4") if layout in FSDP2_LAYOUTS and gradient_mode == "sdp4bit" else ("bf16",)


def tokens_per_second(profile: ProfileData, knobs: ProblemSettings, step_seconds: float) -> float:
    """Tokens trained per second: micro_batch x grad_accum x seq_len / step seconds (0 without a step time)."""
    mb = knobs.micro_batch or int(profile.settings.get("micro_batch", 1) or 1)
    tokens = mb * knobs.grad_accum * int(profile.settings.get("seq_len", 1) or 1)
    return tokens / step_seconds if step_seconds > 0 else 0.0


def _dominated(p: ChoiceProblem, q: ChoiceProblem) -> bool:
    """True when q is at least as good as p in static bytes, optimizer-step floor and base seconds (same options)."""
    return bool(np.all(q.static_bytes <= p.static_bytes) and np.all(q.peak_floor() <= p.peak_floor())
                and q.base_seconds <= p.base_seconds and q.laaq_layer_seconds <= p.laaq_layer_seconds)


def solve_knobs(profile: ProfileData, budget, *, objective: str = "time", error_cap: Optional[float] = None,
                time_cap=None, space: KnobSpace = KnobSpace(),
                base: ProblemSettings = ProblemSettings(), prune: bool = True,
                before_binding: Optional[Callable[[], object]] = None) -> KnobSearch:
    """The best combination of `space` under `budget` bytes per stage and the caps (see the module docstring).
    `time_cap` is seconds, None or "checkpoint" (each combination no slower than its own best checkpointing that
    fits). Raises InfeasibleBudget when no combination fits, with the smallest budget
    any combination fits. `before_binding` is called once the best is found, before its binding constraints are
    solved: their solves stop at a time limit (BINDING_SECONDS), so what the caller runs beside the search
    (agoq.search.search: the alternatives) is waited for there, not left to take their cores."""
    tried: list[KnobResult] = []
    built = []
    for knobs in combinations(profile, space, base):
        try:
            built.append((knobs, build_problem(profile, knobs)))
        except ValueError as e:  # e.g. a micro-batch the config cannot scale to: say so, try the others
            tried.append(KnobResult(knobs, error=str(e)))
    first = (lambda r: r.alloc.grad_error) if objective == "error" else (lambda r: r.alloc.step_seconds)
    refused: list[InfeasibleBudget] = []  # why each combination that was solved does not fit
    bounded: list[tuple[float, int, KnobResult]] = []
    hopeless: list[KnobResult] = []  # does not fit (its relaxation, or its MILP): solved to say why only if none fits
    relaxing: list[tuple[int, KnobResult]] = []  # to be bounded by their linear relaxations
    for i, (knobs, problem) in enumerate(built):
        same = [q for k, q in built if k is not knobs and (k.micro_batch, k.compile_mode) == (knobs.micro_batch,
                                                                                              knobs.compile_mode)]
        if prune and any(_dominated(problem, q) and not _dominated(q, problem) for q in same):
            tried.append(KnobResult(knobs, problem, error="dominated"))
            continue
        result = KnobResult(knobs, problem)
        try:
            result.time_cap = resolve_time_cap(problem, budget, time_cap)
        except InfeasibleBudget as e:
            result.error = str(e)
            refused.append(e)
            tried.append(result)
            continue
        result.solver = Solver(problem, tie_break=False)  # the first objective only; the winner's ties broken below
        relaxing.append((i, result))

    def relaxed(item):  # one LP each, two at a time (HiGHS releases the GIL; relaxed_bound uses no pool itself)
        r = item[1]
        return r.solver.relaxed_bound(budget, objective, r.time_cap, error_cap) if prune else -np.inf

    for (i, result), bound in zip(relaxing, lp_pool().map(relaxed, relaxing)):
        if bound is None:
            hopeless.append(result)
        else:
            bounded.append((bound, i, result))
    # best bound first; a combination whose relaxation is already worse than the best exact optimum found cannot
    # win or tie (a relaxation's optimum is never worse than its MILP's), so its MILP is never solved
    top = np.inf
    for bound, _, result in sorted(bounded, key=lambda t: (t[0], t[1])):
        if bound > top + abs(top) * 1e-6:
            result.error = "slower" if objective == "time" else "less exact"
            tried.append(result)
            continue
        result.solver.explain = False  # why it does not fit is asked below, only if nothing fits
        try:
            result.alloc = result.solver.solve(budget, objective, result.time_cap, error_cap=error_cap)
            result.tokens_per_second = tokens_per_second(profile, result.knobs, result.alloc.step_seconds)
            top = min(top, first(result))
        except InfeasibleBudget:
            hopeless.append(result)
            continue
        finally:
            result.solver.explain = True
        tried.append(result)
    solved = [r for r in tried if r.alloc is not None]
    for result in hopeless:
        result.error = "does not fit the budget"
        tried.append(result)
    fits_at = None  # where nothing fits, the least budget one of them fits: the answer
    if not solved and hopeless:
        fits_at, _ = least_budget([(r.solver, r.time_cap) for r in hopeless], error_cap)
        if fits_at is None:  # no combination meets the caps at any budget: each says why
            for result in hopeless:
                try:
                    result.solver.solve(budget, objective, result.time_cap, error_cap=error_cap)
                except InfeasibleBudget as e:
                    result.error = str(e)
                    refused.append(e)
    position = {id(knobs): i for i, knobs in enumerate(k for k, _ in built)}
    tried.sort(key=lambda r: position.get(id(r.knobs), -1))  # the combinations' own order, whatever was solved first
    if not solved:
        asked = int(np.min(np.atleast_1d(budget)))
        least = min([e.smallest_budget for e in refused if e.smallest_budget is not None]
                    + ([fits_at] if fits_at is not None else []), default=None)
        if least is None:
            reasons = "; ".join(dict.fromkeys(r.error for r in tried if r.error and r.error != "dominated"))
            caps = tuple(dict.fromkeys(cap for e in refused for cap in e.caps))
            raise InfeasibleBudget(f"no knob combination meets the caps at any budget: {reasons}", None, caps)
        raise InfeasibleBudget(
            f"no knob combination (gradient storage, layout, optimizer, micro-batch, compile mode) fits a budget of "
            f"{format_bytes_apart(asked, least)[0]} per GPU: the smallest feasible budget is "
            f"{format_bytes_apart(least, asked)[0]} ({least} bytes)", least)
    top = min(first(r) for r in solved)
    tied = [r for r in solved if first(r) <= top + abs(top) * 1e-9 + 1e-15]  # their ties broken by the second
    for r in solved:
        if not any(r is t for t in tied):
            r.error = "slower" if objective == "time" else "less exact"
    early = None
    with quiet_stdout():  # (the early question's solves are a side thread's: kept quiet by the caller's thread)
        if BINDING_BESIDE and len(tied) == 1 and (os.cpu_count() or 1) > 1:
            # one winner: its binding constraints are asked beside its tie-break, a core each (on the H100 probe's
            # smallest budget 0.3 s each, one after the other), once what runs beside the search is in (the
            # tie-break does not wait for it: at loose budgets the alternatives' pricing outlasts the search). The
            # tie-break keeps the first objective, within FIRST_GAP of its optimum, or betters it: bettered, the
            # question is asked again of the new value
            winner, mine, after = tied[0], first(tied[0]), before_binding  # (its value before the tie-break)

            def ask():
                if after is not None:
                    after()  # submitted to side_pool before this question: never waits for a thread this one holds
                return binding_constraints(winner.problem, mine, budget, objective, error_cap, winner.time_cap)

            early = (mine, side_pool().submit(ask))
            before_binding = None
        try:
            for r in tied:
                r.solver.tie_break = True  # its first objective is not solved again
                r.alloc = r.solver.solve(budget, objective, r.time_cap, error_cap=error_cap)
                r.tokens_per_second = tokens_per_second(profile, r.knobs, r.alloc.step_seconds)
        except BaseException:
            if early is not None and not early[1].cancel():
                wait([early[1]])  # its solves end before stdout is back
            raise
        best = min(tied, key=lambda r: r.key(objective))
        if early is not None:
            binding = early[1].result()  # waited for even when asked again below: no solve is left running
            if abs(first(best) - early[0]) <= abs(early[0]) * 1e-9 + 1e-15:
                return KnobSearch(best, tried, binding)
        if before_binding is not None:
            before_binding()
        return KnobSearch(best, tried, binding_constraints(best.problem, first(best), budget, objective, error_cap,
                                                           best.time_cap))


def least_budget(solvers: list, error_cap: Optional[float] = None) -> tuple[Optional[int], Optional[int]]:
    """(the least budget, bytes per stage, that a choice of one of `solvers` fits, each under its own time cap and
    the shared `error_cap`; the index of the one that fits it), (None, None) when none meets the caps. `solvers`:
    [(Solver, time cap or None)].

    Best bound first: each one's least peak is bounded from below by its linear relaxation (one LP each, two at a
    time), and the lowest bound, when taken, by its offloaded prefixes' relaxations (tighter: taken again in its
    turn); one whose bound is no lower than the least found so far is not solved, and the others are asked only for
    a choice under it (agoq.search.milp_least's `below`). On the H200 probe profile under the recipe's error cap
    its 16 combinations' least peaks took 73 s solved each in full as one MILP, one after another, and a refused
    `agoq search` 40 s; this answer, the same, 2 s (2-core CPU)."""
    bounds = lp_pool().map(lambda item: item[0].least_memory_bound(item[1], error_cap), solvers)
    queue = [(b, i, False) for i, b in enumerate(bounds) if b is not None]
    heapq.heapify(queue)
    least, who, ranked = None, None, []
    while queue and (least is None or queue[0][0] < least):  # the first pass: quick solves, for a least to beat
        bound, i, tight = heapq.heappop(queue)
        solver, time_cap = solvers[i]
        if not tight:
            tighter = solver.least_memory_bound(time_cap, error_cap, by_prefix=True)
            if tighter is not None:
                heapq.heappush(queue, (max(bound, tighter), i, True))
            continue
        ranked.append((bound, i))
        alloc = solver.least_memory(time_cap, error_cap, time_limit=QUICK_SECONDS, below=least, patient=False)
        if alloc is not None:
            least, who = int(max(alloc.peak_bytes_per_stage)), i  # floor included
    for bound, i in ranked:  # the second: each one whose bound is below the least found, exactly
        if least is not None and bound >= least:
            continue
        solver, time_cap = solvers[i]
        alloc = solver.least_memory(time_cap, error_cap, below=least)
        if alloc is not None:
            least, who = int(max(alloc.peak_bytes_per_stage)), i
    return least, who


QUICK_SECONDS = 0.2  # least_budget's first pass: each combination's least peak searched this long at most


def budget_bounds(profile: ProfileData, space: KnobSpace = KnobSpace(),
                  base: ProblemSettings = ProblemSettings()) -> tuple[Optional[int], int]:
    """(the smallest budget any combination of `space` fits with no caps — None if none fits at any budget —,
    the largest peak of a combination's plan that keeps everything: more buys nothing), bytes per stage."""
    built = []
    for knobs in combinations(profile, space, base):
        try:
            built.append(Solver(build_problem(profile, knobs)))
        except ValueError:  # a combination the profile cannot price: it bounds nothing
            continue

    def keeps_everything(solver) -> Optional[int]:  # its plan's peak with no memory limit; None: fits no budget
        try:
            return int(math.ceil(max(solver.solve(math.inf).peak_bytes_per_stage)))
        except InfeasibleBudget:
            return None

    # two at a time (HiGHS releases the GIL; Solver.solve uses no pool itself): the 48 combinations of the 2-GPU
    # probe profile took 6.6 s one after another
    peaks = list(lp_pool().map(keeps_everything, built))
    solvers = [(solver, None) for solver, peak in zip(built, peaks) if peak is not None]
    return least_budget(solvers)[0], max((p for p in peaks if p is not None), default=0)


BINDING_SECONDS = 0.3  # a relaxed solve of binding_constraints stops here
BINDING_BESIDE = True  # False: the winner's binding constraints asked after its tie-break, not beside it


def binding_constraints(problem, mine: float, budget, objective: str, error_cap: Optional[float],
                        time_cap: Optional[float]) -> list[str]:
    """Which constraints bind a plan of `problem` whose first objective is `mine` (step seconds or gradient error):
    those whose removal (one at a time, same knobs) improves that objective by more than the first objective's MIP
    gap (FIRST_GAP, relative: a plan within it of its optimum would otherwise name a constraint that a better choice
    under the same constraints beats); ["none"] when none does. Each removal asks Solver.improves (a relaxation that
    cannot improve answers without a solve; a solve stops after BINDING_SECONDS and names the constraint binding only
    where it found an improvement by then: a plan request on the H100 probe profile's tightest budget waited 5-7 s in
    four of five requests where the relaxed solve, stopped before any choice, searched on without a limit)."""
    solver = Solver(problem, tie_break=False)
    out = []
    relaxed = {"memory budget": dict(budget=math.inf, error_cap=error_cap, time_cap=time_cap)}
    if error_cap is not None:
        relaxed["error cap"] = dict(budget=budget, error_cap=None, time_cap=time_cap)
    if time_cap is not None:
        relaxed["time cap"] = dict(budget=budget, error_cap=error_cap, time_cap=None)
    for name, args in relaxed.items():
        if name == "memory budget" and _unbounded_keeps_improve(problem, objective, mine, error_cap, time_cap):
            out.append(name)  # shown without a solve: keeping every tensor as it is does better
            continue
        if solver.improves(np.full(problem.num_stages, float(args["budget"])), objective,
                           mine - FIRST_GAP * max(abs(mine), 1e-12), time_cap=args["time_cap"],
                           error_cap=args["error_cap"], time_limit=BINDING_SECONDS):
            out.append(name)
    return out or ["none"]


def _unbounded_keeps_improve(problem, objective: str, mine: float, error_cap: Optional[float],
                             time_cap: Optional[float]) -> bool:
    """Whether the choice that keeps every tensor as it is (every kind at 16, no layer checkpointed or offloaded:
    the fastest and exact choice when memory is no constraint) meets the caps and improves on `mine`: then the
    memory budget binds, without a solve."""
    chosen = np.nonzero(problem.keeps_16bit())[0]
    if len(chosen) != len(problem.groups()):  # some (layer, kind) has no 16 option
        return False
    figures = problem.evaluate(chosen, np.zeros(problem.num_layers, dtype=bool))
    if error_cap is not None and figures["grad_error"] > error_cap * (1 + 1e-9):
        return False
    if time_cap is not None and figures["step_seconds"] > time_cap * (1 + 1e-9):
        return False
    kept = figures["grad_error"] if objective == "error" else figures["step_seconds"]
    return kept < mine - FIRST_GAP * max(abs(mine), 1e-12)


def knob_values(profile: ProfileData, knobs: ProblemSettings) -> dict:
    """The knob values of a combination as a plan records them."""
    optimizer, master = resolve_optimizer(profile, knobs.optimizer, knobs.master)
    return {"gradients": knobs.gradient_mode, "layout": resolve_layout(knobs.layout, knobs.gradient_mode),
            "optimizer": optimizer, "master": master,
            "micro_batch": int(knobs.micro_batch or profile.settings.get("micro_batch", 1) or 1),
            "grad_accum": int(knobs.grad_accum), "compile": knobs.compile_mode or profile_compile_mode(profile),
            **({"weight_gather": knobs.weight_gather} if knobs.weight_gather != "bf16" else {})}


__all__ = ["KnobSpace", "KnobResult", "KnobSearch", "combinations", "solve_knobs", "binding_constraints", "budget_bounds",
           "least_budget",
           "tokens_per_second", "knob_values", "weight_gathers", "MASTER_CHOICES"]
