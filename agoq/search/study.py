"""Multi-objective search over the knobs the per-layer MILP cannot add up: an Optuna study (ask/tell).

Each trial picks knobs (block size, 4-bit format, gradient mode, micro-batch and gradient accumulation at a
fixed number of sequences per step, per-kind floor bits, pipeline stage boundaries), solves the per-layer
choice exactly with the MILP under the budget, and reports three objectives, all minimised: peak memory
(bytes, the largest stage's), step time (seconds) and gradient error. With `measure`, each trial's plan
is also run for real (as a Ray task when a runner has Ray) and the measured peak and step time replace
the predicted ones. A plan over budget is reported as a constraint violation (NSGA-II and TPE honour
it). The first trial is the MILP plan with the profile's own knobs (warm start).

Storage: Optuna's; an SQLite file by default, a journal file (``*.journal``) for several processes on
one file system, or any database URL (e.g. PostgreSQL) for several machines. Rerunning with the same
storage and study name resumes: only the trials still missing are run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from agoq.runtime.activations.policy import KINDS
from agoq.formats.profile import ProfileData
from agoq.progress import progress_bar
from agoq.search.costs import ProblemSettings, build_problem, gradient_modes, optimizer_choices
from agoq.search.layouts import layouts
from agoq.search.milp import InfeasibleBudget, Solver, resolve_time_cap
from agoq.search.timing import prices, profile_compile_mode

SAMPLERS = ("nsga2", "tpe")
BLOCKS = (32, 64, 128, 256)
FLOOR_BITS = (2, 3, 4, 5, 6, 8)
DEFAULT_STUDY = "agoq-search"


def storage_file(storage: str) -> Optional[Path]:
    """The local file a storage writes (a .journal path, or an sqlite:/// URL's database), None for a database
    server's URL; ValueError for a string that is neither a URL nor a .journal path."""
    if "://" not in storage:
        if not storage.endswith(".journal"):
            raise ValueError(f"--storage must be a database URL (sqlite:///study.db, postgresql://...) or a path "
                             f"ending in .journal, got {storage!r}")
        return Path(storage)
    return Path(storage[len("sqlite:///"):]) if storage.startswith("sqlite:///") else None


def open_storage(storage: str):
    """An Optuna storage from a URL (sqlite:///..., postgresql://...) or a path ending in .journal."""
    import optuna

    path = storage_file(storage)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    if "://" not in storage:
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(storage))
    return optuna.storages.RDBStorage(storage)


def _constraints(trial) -> list[float]:
    return list(trial.user_attrs.get("constraint", [1.0]))


@dataclass
class TrialResult:
    """One finished trial: its knobs, allocation, figures and (if run) measurement."""

    number: int
    knobs: ProblemSettings
    alloc: Any
    problem: Any
    feasible: bool
    measured: Optional[dict] = None
    values: tuple = ()


@dataclass
class StudyResult:
    """The study's completed trials (this run's and earlier ones') and its feasible Pareto front."""

    study: Any
    trials: list = field(default_factory=list)      # TrialResult of the trials run now
    front: list = field(default_factory=list)       # optuna FrozenTrial of the feasible Pareto front
    ran: int = 0


class KnobSpace:
    """Which knobs a profile allows, and turning a trial's suggestions into ProblemSettings."""

    def __init__(self, profile: ProfileData, sequences_per_step: Optional[int] = None,
                 gradient_modes_allowed: Optional[tuple] = None, base: ProblemSettings = ProblemSettings(),
                 layouts_allowed: Optional[tuple] = None):
        """`base`: the knobs a trial does not vary (optimizer, masters, compile mode: the MILP's best plan's) and
        its layout where the trial's gradient storage allows it. `layouts_allowed` (None: every one the profile
        offers) keeps trials to those layouts, and to the gradient storages that can take one of them."""
        self.profile = profile
        self.base = base
        s = profile.settings
        self.has_config = bool(profile.model_config())
        self.profiled_micro_batch = int(s.get("micro_batch", 1) or 1)
        self.sequences = int(sequences_per_step or self.profiled_micro_batch)
        divisors = [d for d in range(1, self.sequences + 1) if self.sequences % d == 0] \
            if self.has_config else [self.profiled_micro_batch]
        # splits the profile measured steps at (agoq.search.timing): the others are not offered
        steps, mode = prices(profile), base.compile_mode or profile_compile_mode(profile)
        self.micro_batches = [d for d in divisors if steps.seconds(mode, d, self.sequences // d) is not None] \
            or [self.profiled_micro_batch]
        self.modes = [m for m in gradient_modes(profile) if gradient_modes_allowed is None or m in gradient_modes_allowed]
        if not self.modes:
            raise ValueError(f"no gradient storage of {gradient_modes_allowed} has figures in the profile")
        self.formats = ["int", "nf4"] if (profile.table["format"] == "nf4").any() else ["int"]
        self.block0 = int(s.get("block", 128) or 128)
        self.blocks = sorted(set(BLOCKS) | {self.block0}) if self.has_config else [self.block0]
        self.stages = profile.num_stages()
        self.layer_stage0 = profile.layer_stage()
        quantized = profile.table[~profile.table["option"].isin(["16", "recompute"])]
        self.floor_choices = sorted({int(b) for b in quantized["bits"]}) or [2]
        # data-parallel layouts (agoq.search.layouts): one categorical over every layout some allowed gradient
        # storage may take, so its choices are the same in every trial; a trial whose storage cannot take the
        # layout it drew runs its storage's own
        self.world = profile.world_size
        self._layouts_of = {m: [lay for lay in layouts(self.world, profile.collectives, m, self.stages,
                                                       node_size=profile.node_size)
                                if layouts_allowed is None or lay in layouts_allowed] for m in self.modes}
        self.modes = [m for m in self.modes if self._layouts_of[m]]
        if not self.modes:
            raise ValueError(f"no gradient storage of the profile can take a layout of {layouts_allowed}")
        self.layouts = sorted({lay for m in self.modes for lay in self._layouts_of[m]})

    def defaults(self) -> dict:
        """The profile's own knobs: the warm-start trial."""
        mb = self.profiled_micro_batch if self.profiled_micro_batch in self.micro_batches else self.micro_batches[-1]
        d = {"block": self.block0, "format": "int", "gradient_mode": "bf16" if "bf16" in self.modes else self.modes[0],
             "micro_batch": mb}
        d.update({f"floor_{k}": self.floor_choices[0] for k in KINDS})
        d.update({f"stage_shift_{i}": 0 for i in range(1, self.stages)})
        if len(self.layouts) > 1:
            d["layout"] = self.base.layout if self.base.layout in self.layouts else self._layouts_of[d["gradient_mode"]][0]
        return d

    def suggest(self, trial) -> ProblemSettings:
        block = trial.suggest_categorical("block", self.blocks)
        fmt = trial.suggest_categorical("format", self.formats)
        mode = trial.suggest_categorical("gradient_mode", self.modes)
        mb = trial.suggest_categorical("micro_batch", self.micro_batches)
        floors = tuple((k, trial.suggest_categorical(f"floor_{k}", self.floor_choices)) for k in KINDS)
        layer_stage = None
        if self.stages > 1:
            bounds = [self.layer_stage0.index(s) for s in range(1, self.stages)]
            L = len(self.layer_stage0)
            moved = []
            for i, b in enumerate(bounds, start=1):
                shift = trial.suggest_int(f"stage_shift_{i}", -2, 2)
                moved.append(b + shift)
            if all(a < b for a, b in zip([0] + moved, moved + [L])):  # every stage keeps a layer
                layer_stage = tuple(int(np.searchsorted(moved, l, side="right")) for l in range(L))
            else:
                layer_stage = tuple(self.layer_stage0)
        layout = trial.suggest_categorical("layout", self.layouts) if len(self.layouts) > 1 else self.layouts[0]
        if layout not in self._layouts_of[mode]:
            layout = self._layouts_of[mode][0]
        choices = optimizer_choices(mode, layout)
        optimizer, master = ((self.base.optimizer, self.base.master) if (self.base.optimizer, self.base.master)
                             in choices else choices[0])
        return ProblemSettings(block=block, format=fmt, floor_bits=floors, micro_batch=mb, grad_accum=self.sequences // mb,
                               gradient_mode=mode, layer_stage=layer_stage, layout=layout, optimizer=optimizer,
                               master=master, compile_mode=self.base.compile_mode,
                               quantize_attention=self.base.quantize_attention)


def knobs_dict(knobs: ProblemSettings) -> dict:
    """ProblemSettings as flat, CSV-ready values."""
    d = {"block": knobs.block, "format": knobs.format, "gradient_mode": knobs.gradient_mode,
         "micro_batch": knobs.micro_batch, "grad_accum": knobs.grad_accum, "layout": knobs.layout,
         "optimizer": knobs.optimizer, "master": knobs.master, "compile_mode": knobs.compile_mode}
    d.update({f"floor_{k}": b for k, b in knobs.floor_bits})
    if knobs.layer_stage is not None:
        d["layer_stage"] = "".join(map(str, knobs.layer_stage))
    return d


def run_study(profile: ProfileData, budget: int, *, storage: str, study_name: str = DEFAULT_STUDY,
              trials: int = 40, objective: str = "error", time_cap="checkpoint", error_cap: Optional[float] = None,
              sampler: str = "nsga2", seed: int = 0, sequences_per_step: Optional[int] = None,
              measure: Optional[Callable[[list], list]] = None, parallel: int = 1,
              progress: bool = True, stop_after: Optional[int] = None,
              gradient_modes_allowed: Optional[tuple] = None,
              base: ProblemSettings = ProblemSettings(), layouts_allowed: Optional[tuple] = None) -> StudyResult:
    """Run the study until it holds `trials` finished trials (resuming an existing one); returns them.

    `measure(list of (TrialResult)) -> list of dicts with peak_bytes and step_seconds` runs plans for
    real (`parallel` at a time); `stop_after` stops this call after that many new trials (to test resume);
    `gradient_modes_allowed` keeps the trials to those gradient storages (None: every one the profile has);
    `base` holds the knobs trials do not vary and `layouts_allowed` the layouts they may take (see KnobSpace).
    """
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    # optuna >= 5 reads constraints the trial states itself; older versions take a function
    own_constraints = hasattr(optuna.trial.Trial, "set_constraint")
    extra = {} if own_constraints else {"constraints_func": _constraints}
    if sampler == "nsga2":
        smp = optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(20, trials // 2)), **extra)
    else:
        smp = optuna.samplers.TPESampler(seed=seed, multivariate=True, **extra)
    study = optuna.create_study(study_name=study_name, storage=open_storage(storage), sampler=smp,
                                directions=["minimize", "minimize", "minimize"], load_if_exists=True)
    meta = {"budget_bytes": int(budget), "objective": objective, "profile": str(profile.path),
            "fingerprint": profile.fingerprint}
    old = study.user_attrs.get("search")
    if old and (old["budget_bytes"] != meta["budget_bytes"] or old["fingerprint"] != meta["fingerprint"]):
        raise ValueError(f"study {study_name!r} in {storage} was made for another budget or model ({old}); "
                         "use another --out folder, --storage or --study-name")
    study.set_user_attr("search", meta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # set_metric_names is marked experimental
        study.set_metric_names(["peak_bytes", "step_seconds", "grad_error"])
    if parallel <= 1:  # one process owns the study: trials left running by an interrupted run failed
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)
    space = KnobSpace(profile, sequences_per_step, gradient_modes_allowed, base, layouts_allowed)
    finished = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if not study.trials:
        study.enqueue_trial(space.defaults())
    todo = max(0, trials - len(finished))
    if stop_after is not None:
        todo = min(todo, stop_after)
    result = StudyResult(study)
    bar = None
    if progress and todo:
        bar = progress_bar(total=todo, desc="optuna trials", unit="trial")
    solvers: dict = {}
    while todo > 0:
        batch = []
        for _ in range(min(parallel, todo)):
            trial = study.ask()
            knobs = space.suggest(trial)
            batch.append((trial, knobs))
        results = []
        for trial, knobs in batch:
            key = knobs
            if key not in solvers:
                problem = build_problem(profile, knobs)
                solvers[key] = (problem, Solver(problem), resolve_time_cap(problem, budget, time_cap))
            problem, solver, cap = solvers[key]
            try:
                alloc = solver.solve(budget, objective, cap, error_cap=error_cap)
                feasible = True
            except InfeasibleBudget as e:
                if e.smallest_budget is None:
                    study.tell(trial, state=TrialState.FAIL)
                    todo -= 1
                    if bar:
                        bar.update(1)
                    continue
                alloc = solver.solve(e.smallest_budget, objective, cap, error_cap=error_cap)
                feasible = False
            results.append((trial, TrialResult(trial.number, knobs, alloc, problem, feasible)))
        measured = measure([r for _, r in results if r.feasible]) if measure else []
        it = iter(measured)
        for trial, r in results:
            peak = float(max(r.alloc.peak_bytes_per_stage))
            seconds = r.alloc.step_seconds
            if r.feasible and measure:
                r.measured = next(it)
                if r.measured.get("peak_bytes") is not None:
                    peak = float(r.measured["peak_bytes"])
                seconds = float(r.measured["step_seconds"])
                trial.set_user_attr("measured", r.measured)
            trial.set_user_attr("constraint", [peak - budget])
            if own_constraints:
                trial.set_constraint("peak_over_budget", peak - budget)
            trial.set_user_attr("predicted", {"peak_bytes_per_stage": r.alloc.peak_bytes_per_stage,
                                              "step_seconds": r.alloc.step_seconds, "grad_error": r.alloc.grad_error})
            trial.set_user_attr("knobs", knobs_dict(r.knobs))
            r.values = (peak, seconds, r.alloc.grad_error)
            study.tell(trial, list(r.values))
            result.trials.append(r)
            todo -= 1
            result.ran += 1
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    result.front = feasible_front(study)
    return result


def feasible_front(study) -> list:
    """The study's Pareto-optimal completed trials among those within the budget."""
    from optuna.trial import TrialState

    from agoq.search.pareto import non_dominated

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if all(c <= 0 for c in t.user_attrs.get("constraint", [1.0]))]
    unique: dict = {}
    for t in done:  # trials whose knobs differ but whose figures are the same: keep the first
        unique.setdefault(tuple(t.values), t)
    return sorted(non_dominated(list(unique.values()), lambda t: tuple(t.values)), key=lambda t: tuple(t.values))


def knobs_from_trial(trial, space: KnobSpace) -> ProblemSettings:
    """Rebuild a trial's ProblemSettings from its parameters (for a trial of an earlier run)."""
    import optuna

    fixed = optuna.trial.FixedTrial({**space.defaults(), **trial.params})  # a knob newer than the trial: default
    return space.suggest(fixed)
