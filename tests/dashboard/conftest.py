"""Dashboard fixtures: a folder of real outputs of `agoq profile`, `agoq search` and `agoq train` on the
tiny model (made once per session by the demo's loop, at tiny sizes), and a folder in the same formats
with what a short session cannot produce (a long run, several ranks and stages, collective timings,
validated Pareto points, an Optuna journal)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from tests.dashboard import synthetic

FAST_PROFILE = ["--seq-len", "32", "--batches", "1", "--bits", "2,4,8", "--formats", "int", "--world-size", "2",
                "--collective-sizes", "16KiB,64KiB"]
FAST_SEARCH = ["--objective", "time", "--method", "both", "--trials", "4", "--validate", "1",
               "--validate-steps", "2", "--front-budgets", "4"]
FAST_TRAIN = ["--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "0"]


@pytest.fixture(scope="session")
def stage_root(tmp_path_factory) -> Path:
    """A root holding demo/ (profile, search, runs/baseline, runs/plan) made by the real stage commands."""
    from agoq.commands import demo

    root = tmp_path_factory.mktemp("stages")
    demo.run_loop(root / "demo", steps=4, quiet=True, profile_args=FAST_PROFILE, search_args=FAST_SEARCH,
                  train_args=FAST_TRAIN)
    return root


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory, named_seed) -> Path:
    """A root in agoq's formats with random contents (see tests/dashboard/synthetic.py)."""
    import optuna

    rng = np.random.default_rng(named_seed("synthetic_root"))
    root = tmp_path_factory.mktemp("synthetic")
    layers = 5
    synthetic.write_profile(root / "prof", rng, layers, "0123456789abcdef")
    plan = synthetic.make_plan(rng, layers, "0123456789abcdef", stages=2)
    search = root / "search"
    search.mkdir()
    (search / "plan.json").write_text(json.dumps(plan))
    with open(search / "pareto.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["budget_bytes", "predicted_peak_bytes", "predicted_step_seconds", "predicted_grad_error",
                    "block", "plan", "measured_peak_bytes", "measured_step_seconds"])
        w.writerow([32 * 2**20, 25 * 2**20, 0.05, 0.04, 128, "plan.json", 26 * 2**20, 0.055])
        w.writerow([32 * 2**20, 20 * 2**20, 0.06, 0.08, 64, "", "", ""])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{search / 'study.db'}", directions=["minimize", "minimize"],
                                study_name="bits")
    study.optimize(lambda t: (t.suggest_float("x", 0, 1), (1 - t.params["x"]) ** 2), n_trials=6)
    journal = root / "journal-search"
    journal.mkdir()
    (journal / "best.json").write_text(json.dumps(synthetic.make_plan(rng, layers, "0123456789abcdef")))
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal / "study.journal")))
    study = optuna.create_study(storage=storage, direction="minimize", study_name="knobs")
    study.optimize(lambda t: (t.suggest_int("block", 32, 256) - 100) ** 2, n_trials=5)
    synthetic.write_run(root / "runs" / "two-ranks", rng, 57, ranks=2, plan=plan, val_every=10)
    synthetic.write_run(root / "runs" / "long", rng, 100_000, val_every=1000)
    return root
