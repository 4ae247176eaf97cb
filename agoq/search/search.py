"""The whole search: profile -> outer knobs x MILP and/or Optuna -> best plan, priced against the best
alternative, Pareto front (CSV + plans), validation.

What to search for is a SearchRequest (agoq.search.request: the budget, objective, caps, knob space, method and
its counts, with their defaults: objective "time", the most tokens/s that fits the budget; error cap "recipe", no
more predicted gradient error than the published agoq-paper recipe on this profile; no time cap). `agoq search`
and the dashboard's plan service build one and call `search`; `plan_from_profile` is the one-call form that
`agoq profile --budget` uses. When no plan meets the request they raise InfeasibleBudget, with the smallest
budget that fits (or the caps no budget meets), for the caller to word.
"""

from __future__ import annotations

from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from agoq.formats.plan import Plan
from agoq.formats.profile import ProfileData, load_profile
from agoq.progress import phase
from agoq.search.costs import ProblemSettings, build_problem
from agoq.search.highs import quiet_stdout
from agoq.search.knobs import KnobSearch, combinations, knob_values, solve_knobs
from agoq.search.milp import Solver, resolve_error_cap, resolve_time_cap
from agoq.search.outputs import CSV_COLUMNS, pareto_rows, side_files, write_outputs  # noqa: F401 (agoq search's)
from agoq.search.pareto import memory_error_front
from agoq.search.plan_alternatives import alternatives_pricing, attach_alternatives, unless_an_alternative_is_as_fast
from agoq.search.plan_builder import alternative_knobs, build_plan, plan_of_alternative
from agoq.search.request import CHECKPOINT_CAP, RECIPE_CAP, InfeasibleBudget, KnobSpace, SearchRequest
from agoq.units import format_bytes


@dataclass
class Candidate:
    """A plan the search produced, with where it came from (milp budget point or optuna trial)."""

    plan: Plan
    source: str
    budget_bytes: float
    trial: Optional[int] = None
    on_front: bool = True
    file: Optional[str] = None

    def key(self, objective: str) -> tuple:
        p = self.plan.predicted
        peak = max(p.peak_bytes_per_stage)
        return (p.grad_error, p.step_seconds, peak) if objective == "error" else (p.step_seconds, p.grad_error, peak)


@dataclass
class SearchOutcome:
    """What a search produced: the chosen plan, every front candidate, and notes for the user: `notes` on how the
    cost model priced it (`agoq search` sums them up unless --verbose), `said` those to show whatever the verbosity
    (something asked for that the search could not give)."""

    plan: Plan
    candidates: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    said: list = field(default_factory=list)
    trials_run: int = 0
    trials_total: int = 0


def _recipe_cap(profile: ProfileData, error_cap, notes: list | None = None):
    """`error_cap` as a number or None: "recipe" becomes the recipe's predicted error on the default knobs (the
    stage rule's widths; where the profile lacks them, as for a pipeline profiled at 4 bits only, the recipe at
    4 bits in every stage, said in `notes`)."""
    if error_cap != RECIPE_CAP:
        return error_cap
    try:
        value = resolve_error_cap(build_problem(profile), error_cap)
        what = "the published recipe (agoq-paper)"
    except ValueError:
        one_stage = ProblemSettings(layer_stage=(0,) * profile.num_layers)
        value = resolve_error_cap(build_problem(profile, one_stage), error_cap)  # raises when 4 bits are missing too
        what = "the published recipe at 4 bits in every stage (the profile lacks the stage rule's widths)"
    if notes is not None:
        notes.append(f"error cap {value:.4g}: the predicted gradient error of {what}")
    return value


def _knob_plan(profile: ProfileData, budget: int, objective: str, time_cap, error_cap: Optional[float],
               cap_source: Optional[str], space: KnobSpace, alternatives: bool, progress: bool = False,
               what: str = "the best plan over the knob combinations") -> tuple:
    """The best plan over the outer knobs (agoq.search.knobs), with its decision and best alternative recorded;
    returns (plan, KnobSearch, the alternatives priced: None without `alternatives`). With `progress` a line on
    stderr says `what` is running, for how long (agoq.progress.phase)."""
    with phase(what, enabled=progress) as bar, quiet_stdout():
        # the alternatives are priced beside the search (they need the combinations and the budget, not the plan)
        pricing = alternatives_pricing(profile, budget, combinations(profile, space)) if alternatives else None
        try:
            found = solve_knobs(profile, budget, objective=objective, error_cap=error_cap, time_cap=time_cap,
                                space=space, before_binding=None if pricing is None else lambda: wait([pricing]))
        except BaseException:  # refused (no plan fits): not needed, but done before stdout is back (quiet_stdout)
            if pricing is not None and not pricing.cancel():
                wait([pricing])
            raise
        best = found.best
        plan = build_plan(profile, best.problem, best.alloc, best.knobs, budget, "milp", objective)
        record_decision(plan, profile, found, objective, error_cap, cap_source)
        priced = None
        if alternatives:
            bar.set_postfix_str("pricing the alternatives", refresh=False)
            priced = attach_alternatives(plan, profile, budget, found, None if pricing is None else pricing.result())
            # an alternative stores bf16 gradients: where the request rules them out, it cannot be the plan
            if objective == "time" and (space.gradient_modes is None or "bf16" in space.gradient_modes):
                plan = unless_an_alternative_is_as_fast(plan, profile)
    return plan, found, priced


def record_decision(plan: Plan, profile: ProfileData, found: KnobSearch, objective: str,
                    error_cap: Optional[float], cap_source: Optional[str]) -> None:
    """Write `plan.decision`: objective, caps, binding constraint(s), the chosen knob values and why."""
    best = found.best
    solved = [r for r in found.tried if r.alloc is not None]
    knobs = knob_values(profile, best.knobs)
    what = "the most tokens/s" if objective == "time" else "the least predicted gradient error"
    caps = []
    if error_cap is not None:
        caps.append(f"predicted gradient error <= {error_cap:.4g}" + (f" ({cap_source})" if cap_source else ""))
    if best.time_cap is not None:
        caps.append(f"step <= {best.time_cap:.4f} s")
    reason = (f"{what} of {len(solved)} knob combination(s) that fit the budget"
              + (f" under {' and '.join(caps)}" if caps else "")
              + f"; binding: {', '.join(found.binding)}")
    plan.decision = {"objective": objective, "error_cap": error_cap, "error_cap_source": cap_source,
                     "time_cap": best.time_cap, "binding": list(found.binding), "knobs": knobs,
                     "combinations": len(found.tried), "tokens_per_second": best.tokens_per_second,
                     "reason": reason}


def _milp_plan(profile: ProfileData, knobs: ProblemSettings, budget: int, objective: str, time_cap,
               error_cap: Optional[float] = None):
    problem = build_problem(profile, knobs)
    solver = Solver(problem)
    alloc = solver.solve(budget, objective, resolve_time_cap(problem, budget, time_cap), error_cap=error_cap)
    return problem, solver, alloc


def _cap_source(error_cap) -> Optional[str]:
    """Where the error cap comes from, as the plan's decision records it: "recipe", "given" or None (no cap)."""
    return RECIPE_CAP if error_cap == RECIPE_CAP else ("given" if error_cap is not None else None)


def plan_from_profile(profile_dir, request: Union[SearchRequest, int], *, knobs: Optional[ProblemSettings] = None,
                      alternatives: bool = True, progress: bool = False, what: Optional[str] = None,
                      **changes) -> Plan:
    """The best plan of a profile (folder or ProfileData) for `request`: a SearchRequest, or its budget in bytes
    per GPU (stage) with its other fields as keywords (objective, time_cap, error_cap, space; see SearchRequest).

    With `knobs` (ProblemSettings) the plan uses exactly those knobs; else the outer knobs of the request's space
    (default: every gradient storage, optimizer and compile mode the profile prices, float32 masters, every split
    of the profiled micro-batch) are searched. The plan records its decision and, with `alternatives`, the best
    alternative that fits the budget. Raises InfeasibleBudget (with the smallest feasible budget) when none fits.
    `progress`: a line on stderr while the knobs are searched, saying `what` is (agoq.progress.phase)."""
    r = SearchRequest.of(request, changes)
    profile = profile_dir if isinstance(profile_dir, ProfileData) else load_profile(profile_dir)
    error_cap = _recipe_cap(profile, r.error_cap)
    if knobs is not None:
        problem, _, alloc = _milp_plan(profile, knobs, r.budget, r.objective, r.time_cap, error_cap)
        return build_plan(profile, problem, alloc, knobs, r.budget, "milp", r.objective)
    plan, _, _ = _knob_plan(profile, r.budget, r.objective, r.time_cap, error_cap, _cap_source(r.error_cap),
                            r.space, alternatives, progress, what or "the best plan over the knob combinations")
    return plan


# `agoq search` also looks this far above the budget, and names a plan there at least MUCH_FASTER x the tokens/s: a
# budget just under a cliff (the probe's H100 profile: eager at 9.83 GB, 266.5 ms predicted, 265.6 and 344.7 ms
# measured on two H100s; compiled at 10.03 GB, 159.1 ms measured)
HEADROOM = 0.02
MUCH_FASTER = 1.15


def unpriced_offload_note(profile: ProfileData) -> Optional[str]:
    """Why a profile offers no offload at all, for a user who asked for it: it did not measure the host link (CPU
    profiles, and GPU profiles made before agoq measured it); None when it did."""
    if profile.host_link:
        return None
    return ("this profile did not measure the host link (timing.host_link), so offload cannot be priced and no plan "
            "offloads: --offload and --host-budget change nothing here; re-profile on a GPU with agoq profile MODEL "
            "(on a CUDA device it measures the host link and the offloading steps) to offer it")


def roomier_plan_note(profile: ProfileData, request: Union[SearchRequest, int], plan: Plan, *, progress: bool = False,
                      **changes) -> Optional[str]:
    """A sentence naming what HEADROOM more memory buys when the plan searched at that budget is predicted at least
    MUCH_FASTER x `plan`'s tokens/s (`plan`: the one made for `request`); None otherwise, for objectives other than
    time, and where nothing more fits there. One more search of the knobs (with a bar when `progress`): `agoq search`
    asks, the service does not."""
    r = SearchRequest.of(request, changes)
    if r.objective != "time" or not plan.predicted.step_seconds:
        return None
    more = int(r.budget * (1 + HEADROOM))
    try:
        other = plan_from_profile(profile, r, budget=more, progress=progress,
                                  what=f"the plan of a budget {HEADROOM:.0%} larger, for comparison")
    except InfeasibleBudget:
        return None
    if not other.predicted.step_seconds:
        return None
    ratio = plan.predicted.step_seconds / other.predicted.step_seconds  # both train the request's tokens per step
    if ratio < MUCH_FASTER:
        return None
    t = other.training
    ckpt, offloaded = len(other.checkpoint_layers()), len(other.offload_layers())
    what = (f"{t.compile}, gradients {other.gradients.mode}, micro-batch {t.micro_batch} x {t.grad_accum}"
            + (f", {ckpt} layer(s) checkpointed" if ckpt else "") + (f", {offloaded} offloaded" if offloaded else ""))
    return (f"a budget {HEADROOM:.0%} larger ({format_bytes(more)}, {format_bytes(more - r.budget)} more) gets a plan "
            f"predicted {ratio:.2f}x faster ({what}: {other.predicted.step_seconds * 1e3:.1f} ms a step against "
            f"{plan.predicted.step_seconds * 1e3:.1f}): this budget sits just under where it fits")


def _study_limits(space: KnobSpace) -> dict:
    """The gradient storages and layouts Optuna's trials may use under `space` (None: every one the profile offers);
    a storage that can take none of the layouts is left out by the study itself."""
    return {"gradient_modes_allowed": space.gradient_modes, "layouts_allowed": space.layouts}


def search(profile: ProfileData, request: Union[SearchRequest, int], *, storage: Optional[str] = None,
           study_name: str = "agoq-search", ray_address: Optional[str] = None, parallel: int = 1,
           out_dir: Optional[Path] = None, progress: bool = True, stop_after: Optional[int] = None,
           alternatives: bool = True, measure: Optional[Callable] = None, **changes) -> SearchOutcome:
    """Run the search for `request` (see `agoq search --help`); plans of the fronts are built but not written.

    `request` is a SearchRequest (`changes` replace its fields), or its budget in bytes per GPU with its other
    fields as keywords. The rest says how the search runs: the Optuna study's `storage` (default
    sqlite:///OUT_DIR/study.db; `agoq search` names it after the plan: side_files) and `study_name`, Ray at
    `ray_address` (None: in this process), `parallel` trials at a time, progress bars, at most `stop_after` trials
    now (None: all of them).
    The MILP plan is the best over the outer knobs of the request's space (agoq.search.knobs); the front and the
    Optuna study use that plan's knobs. With `alternatives` the plan carries the best alternative that fits the
    budget (agoq.search.alternatives) and, with `validate`, its measured figures beside the plan's. `validate` and
    `measure_trials` run plans with `measure` (agoq.search.validation; `agoq search` gives agoq.train's). Raises
    InfeasibleBudget when no plan meets the request."""
    r = SearchRequest.of(request, changes)
    if measure is None and (r.validate > 0 or (r.measure_trials and r.method != "milp")):
        raise ValueError("validating plans or measuring trials runs them: pass measure= (agoq.train.measure."
                         "measure_plan, what `agoq search` passes)")
    budget, objective, time_cap = r.budget, r.objective, r.time_cap
    cap_notes: list = []
    error_cap = _recipe_cap(profile, r.error_cap, cap_notes)
    plan, found, priced = _knob_plan(profile, budget, objective, time_cap, error_cap, _cap_source(r.error_cap),
                                     r.space, alternatives, progress)
    knobs, problem = found.best.knobs, found.best.problem
    outcome = SearchOutcome(plan)
    outcome.notes += cap_notes + problem.notes
    candidates = [Candidate(outcome.plan, "milp", budget)]
    if r.method in ("milp", "both") and r.front_budgets > 0:
        solver = Solver(problem)
        cap = (lambda b: resolve_time_cap(problem, b, time_cap)) if time_cap == CHECKPOINT_CAP else time_cap
        try:
            with phase(f"the memory/error Pareto front over {r.front_budgets} budgets", enabled=progress):
                front = memory_error_front(problem, r.front_budgets, objective, cap, solver, False, error_cap)
        except ValueError as e:  # the front's range not found: the plan stands without it, and says so
            front = []
            outcome.said.append(f"no memory/error Pareto front (--front-budgets): {e}; the plan stands without it")
        for point in front:
            candidates.append(Candidate(build_plan(profile, problem, point.alloc, knobs, int(point.budget_bytes),
                                                   "milp", objective), "milp-front", point.budget_bytes))
    runner = None
    if ray_address is not None or (r.measure_trials and r.method != "milp"):
        from agoq.search.validation import Runner

        runner = Runner(ray_address)
    study = None
    if r.method in ("optuna", "both"):
        from agoq.search.study import KnobSpace as TrialSpace
        from agoq.search.study import knobs_from_trial, run_study

        if storage is None:
            storage = f"sqlite:///{(out_dir or Path('.')).resolve() / 'study.db'}"
        trial_measure = None
        if r.measure_trials:
            trial_measure = _trial_measurer(profile, budget, objective, runner, r.validate_steps, r.seed, measure)
        result = run_study(profile, budget, storage=storage, study_name=study_name, trials=r.trials,
                           objective=objective, time_cap=time_cap, error_cap=error_cap, sampler=r.sampler,
                           seed=r.seed, measure=trial_measure, parallel=parallel, progress=progress,
                           stop_after=stop_after, base=knobs, **_study_limits(r.space))
        outcome.trials_run = result.ran
        outcome.trials_total = len(result.study.trials)
        trial_space = TrialSpace(profile, base=knobs, **_study_limits(r.space))
        for t in result.front:
            k = knobs_from_trial(t, trial_space)
            prob, _, a = _milp_plan(profile, k, budget, objective, time_cap, error_cap)
            plan = build_plan(profile, prob, a, k, budget, "optuna", objective)
            plan.source.trial = t.number
            if "measured" in t.user_attrs:
                m = t.user_attrs["measured"]
                plan.measured = {"peak_bytes_per_stage": [m.get("peak_bytes")] + [None] * (plan.pipeline.stages - 1),
                                 "step_seconds": m.get("step_seconds"), "loss_deviation": m.get("loss_deviation"),
                                 "date": m.get("date")}
            candidates.append(Candidate(plan, "optuna", budget, trial=t.number))
        study = result.study
    best = min((c for c in candidates if c.source in ("milp", "optuna")), key=lambda c: c.key(objective))
    if best.plan is not outcome.plan and alternatives:  # those priced for the MILP plan, where they are its
        attach_alternatives(best.plan, profile, budget, found, priced)
    outcome.plan = best.plan
    outcome.candidates = candidates
    if r.validate > 0:
        from agoq.search.validation import Runner

        _validate(profile, r, best, candidates, study, runner or Runner(ray_address), alternatives, progress,
                  measure)
        alt = best.plan.alternative
        if alt is not None and alt.speedup_measured is not None and alt.speedup_measured < 1.0:
            outcome.plan = plan_of_alternative(
                best.plan, f"no agoq: measured for {r.validate_steps} steps, {alt.name} ran "
                           f"{alt.measured.tokens_per_second:,.0f} tokens/s and the plan with agoq "
                           f"{alt.speedup_measured * alt.measured.tokens_per_second:,.0f}: the plan is that alternative",
                profile)
    keep_notes(outcome.plan, outcome.notes + outcome.said)
    return outcome


def keep_notes(plan: Plan, notes: list) -> None:
    """Add `notes` to the plan's source.notes, those it holds already kept once and first: the plan file keeps every
    note a search printed or summed up."""
    kept = list(getattr(plan.source, "notes", None) or [])
    plan.source.notes = list(dict.fromkeys(kept + list(notes)))


def _validate(profile: ProfileData, r: SearchRequest, best: Candidate, candidates: list, study, runner,
              alternatives: bool, progress: bool, measure: Callable) -> None:
    """Run the request's `validate` best distinct plans that fit its budget (the chosen one first) and, with
    `alternatives`, the chosen plan's best alternative for real; their measured figures go into the plans and the
    study (None: no study)."""
    from agoq.search.validation import validate_plans

    ranked = [best] + sorted((c for c in candidates if c is not best
                              and max(c.plan.predicted.peak_bytes_per_stage) <= r.budget),
                             key=lambda c: c.key(r.objective))
    chosen, seen = [], set()
    for c in ranked:
        sig = c.plan.model_dump_json(include={"layers", "activations", "training", "gradients"})
        if sig not in seen:
            seen.add(sig)
            chosen.append(c)
        if len(chosen) == r.validate:
            break
    config = profile.model_config()
    if not config:
        raise ValueError("--validate needs the model config in profile.json (model.config)")
    dtype = str(profile.settings.get("dtype", "bf16"))
    validate_plans([c.plan for c in chosen], config, measure=measure, dtype=dtype, steps=r.validate_steps,
                   seed=r.seed, runner=runner, progress=progress)
    if alternatives and best.plan.alternative is not None:
        with phase(f"running the best alternative ({best.plan.alternative.name}) for real", enabled=progress):
            measure_alternative(best.plan, config, measure=measure, dtype=dtype, steps=r.validate_steps, seed=r.seed,
                                runner=runner)
    if study is not None:
        for c in chosen:
            if c.trial is not None:
                study.set_user_attr(f"validated_trial_{c.trial}", c.plan.measured.model_dump(mode="json"))
        study.set_user_attr("validated", [{"source": c.source, "trial": c.trial,
                                           "measured": c.plan.measured.model_dump(mode="json")} for c in chosen])


def measure_alternative(plan: Plan, model_config: dict, *, measure: Callable, dtype: str = "bf16", steps: int = 4,
                        seed: int = 0, runner=None, device: Optional[str] = None) -> Optional[dict]:
    """Run `plan.alternative` for real with `measure` (agoq.search.validation; what it runs:
    agoq.search.plan_builder.alternative_knobs) and write its measured figures and the plan's measured speed-up into
    the plan."""
    from agoq.search.validation import Runner

    alt = plan.alternative
    if alt is None:
        return None
    data = plan.to_dict()
    data.update(alternative_knobs(plan))
    data.update({"alternative": None, "alternatives": [], "decision": None, "measured": None})
    runner = runner or Runner()
    r = runner.map(measure, [dict(plan=data, model_config=model_config, dtype=dtype, micro_batch=alt.micro_batch,
                                  seq_len=plan.training.seq_len, grad_accum=alt.grad_accum, steps=steps, seed=seed,
                                  device=device)])[0]
    tokens = alt.micro_batch * alt.grad_accum * plan.training.seq_len
    alt.measured = {"step_seconds": r["step_seconds"], "peak_bytes": r["peak_bytes"],
                    "tokens_per_second": tokens / r["step_seconds"] if r["step_seconds"] else None}
    if plan.measured is not None and plan.measured.step_seconds:
        mine = plan.training.micro_batch * plan.training.grad_accum * plan.training.seq_len / plan.measured.step_seconds
        alt.speedup_measured = mine / alt.measured.tokens_per_second if alt.measured.tokens_per_second else None
    plan.alternative = alt
    return r


def _trial_measurer(profile: ProfileData, budget: int, objective: str, runner, steps: int, seed: int,
                    measure_plan: Callable):
    """measure(list of TrialResult) -> measured dicts, running each trial's plan for real with `measure_plan`."""
    from agoq.search.validation import loss_deviation, now

    config = profile.model_config()
    if not config:
        raise ValueError("measuring trials needs the model config in profile.json (model.config)")
    dtype = str(profile.settings.get("dtype", "bf16"))
    reference: dict = {}

    def measure(results: list) -> list:
        jobs = []
        for r in results:
            plan = build_plan(profile, r.problem, r.alloc, r.knobs, budget, "optuna", objective)
            jobs.append(dict(plan=plan.to_dict(), model_config=config, dtype=dtype, micro_batch=plan.training.micro_batch,
                             seq_len=plan.training.seq_len, grad_accum=plan.training.grad_accum, steps=steps, seed=seed))
        shapes = sorted({(j["micro_batch"], j["seq_len"], j["grad_accum"]) for j in jobs} - set(reference))
        refs = [dict(plan=None, model_config=config, dtype=dtype, micro_batch=a, seq_len=b, grad_accum=c, steps=steps,
                     seed=seed) for a, b, c in shapes]
        out = runner.map(measure_plan, jobs + refs)
        for shape, r in zip(shapes, out[len(jobs):]):
            reference[shape] = r
        measured = []
        for j, r in zip(jobs, out[:len(jobs)]):
            ref = reference[(j["micro_batch"], j["seq_len"], j["grad_accum"])]
            measured.append({"peak_bytes": r["peak_bytes"], "step_seconds": r["step_seconds"],
                             "loss_deviation": loss_deviation(r["losses"], ref["losses"]), "date": now()})
        return measured

    return measure
