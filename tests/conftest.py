"""Test session setup: Triton in the interpreter when there is no GPU, and one seed per test.

TRITON_INTERPRET is read when kernels are decorated, so it is set here, before agoq is imported.
Importing agoq then caps oneDNN below AMX on CPUs where its AMX kernels fault (agoq.cpu_isa); torch
itself runs no oneDNN kernel at import, so the cap is in place before the first bf16 product.

Seeds. Every test runs under the autouse fixture `seed`: it seeds Python's `random`, NumPy's global
generator and torch (CPU and CUDA) with a seed of the test's own, and a test that draws random numbers
takes its generators from there (`random.Random(seed)`, `np.random.default_rng(seed)`,
`torch.Generator().manual_seed(seed)`, or the seeded global generators; a helper that needs a new seed
on each call draws it with `random.getrandbits`). The test's seed is derived from the run's base seed and
the test's id, so it is fresh on every run and independent of which other tests run. Fixtures shared by
several tests take theirs from `named_seed`, a function of the base seed too. The base seed is drawn
from os.urandom, or read from the environment variable

    AGOQ_TEST_SEED=<integer>

which reproduces a run: a failing test's report names its seed and the command that reruns it with the
same numbers (`AGOQ_TEST_SEED=<base> python -m pytest '<test id>'`). The base seed is also printed in
the session header.
"""

import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import agoq  # noqa: E402,F401  (agoq.cpu_isa.avoid_amx runs on import)

SEED_VARIABLE = "AGOQ_TEST_SEED"


def _base_seed() -> int:
    raw = os.environ.get(SEED_VARIABLE, "").strip()
    if not raw:
        return int.from_bytes(os.urandom(4), "little") % 2**31
    try:
        return int(raw)
    except ValueError:
        raise pytest.UsageError(f"{SEED_VARIABLE}={raw!r} is not an integer; set it to the base seed a "
                                f"failing test's report names, or unset it for a fresh one") from None


BASE_SEED: int | None = None  # set in pytest_configure


def pytest_configure(config):
    global BASE_SEED
    BASE_SEED = _base_seed()


def derived_seed(name: str) -> int:
    """A seed that is a function of the base seed and `name` only (the same in every process and run order)."""
    return random.Random(f"{BASE_SEED}:{name}").randrange(2**31)


def pytest_report_header(config):
    return f"random seeds: {SEED_VARIABLE}={BASE_SEED} (set it to rerun with the same numbers)"


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """This test's seed; random, numpy.random and torch are seeded with it before the test runs."""
    value = derived_seed(request.node.nodeid)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # seeds CUDA too
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(autouse=True)
def compile_settings_restored():
    """torch.compile's partitioner budget is a setting of the process (agoq.train.apply.apply_compile sets it for a
    plan): each test ends with it as it began, so a test that profiles or trains under compile's budget does not
    change what a later test compiles (a per-layer compiled step under budget 0.1 recomputes, and stochastic rounding
    then draws its random numbers in another order than eager's)."""
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    yield
    functorch_config.activation_memory_budget = before


@pytest.fixture(scope="session")
def named_seed():
    """For fixtures shared by several tests (module or session scope), which run outside any one test's
    seed: named_seed(name) is a seed of the base seed and the name (the fixture's, say)."""
    return derived_seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says which seed it ran with and how to rerun it with the same numbers."""
    outcome = yield
    report = outcome.get_result()
    value = dict(item.user_properties).get("seed")
    if not report.failed or value is None:
        return
    text = (f"seed {value}; rerun with the same random numbers:\n"
            f"  {SEED_VARIABLE}={BASE_SEED} python -m pytest '{item.nodeid}'")
    if hasattr(report.longrepr, "addsection"):
        report.longrepr.addsection("random seed", text)
    else:
        report.sections.append(("random seed", text))
