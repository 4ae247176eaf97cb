"""Options the MILP leaves out where each layer takes its own setting (agoq.search.milp_model.dominated_options):
checked against their definition option by option, and the MILP's answers with them left out against the same
MILP with every option offered, for both objectives and the tie-break, on random problems with ties built in."""

import random
from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import Bounds

from agoq.search.milp import InfeasibleBudget, Solver
from agoq.search.milp_model import dominated_options
from tests.search.test_milp import random_problem


def with_ties(rng, p):
    """`p` with some options copied from another of their group (bytes, seconds and error equal: exact ties) or
    made no better than one (a dominated option), so that every branch of the rule is taken."""
    memory, seconds, error = p.memory.copy(), p.seconds.copy(), p.error.copy()
    for idx in p.groups().values():
        rest = [i for i in idx if p.option[i] != "16"]
        if len(rest) < 2 or rng.random() < 0.3:
            continue
        a, b = rng.sample(rest, 2)
        worse = rng.random() < 0.5
        memory[b] = memory[a] + (rng.randint(0, 5) if worse else 0)
        seconds[b] = seconds[a] + (rng.uniform(0, 0.1) if worse else 0.0)
        error[b] = error[a] + (rng.uniform(0, 0.01) if worse else 0.0)
    return replace(p, memory=memory, seconds=seconds, error=error)


def test_dominated_options_match_their_definition():
    seed = random.getrandbits(32)
    rng = random.Random(seed)
    for _ in range(20):
        p = with_ties(rng, random_problem(rng, layers=rng.randint(2, 7), kinds_per_layer=rng.randint(2, 4)))
        out = dominated_options(p)
        for idx in p.groups().values():
            rest = [int(i) for i in idx if p.option[i] != "16"]
            for i in idx:
                if p.option[i] == "16":
                    assert not out[i], f"seed {seed}: a 16 option is never left out"
            kept = [i for i in rest if not out[i]]
            assert kept, f"seed {seed}: every group keeps an option not at 16"
            for o in rest:
                beats = [j for j in kept if j != o and p.memory[j] <= p.memory[o] and p.seconds[j] <= p.seconds[o]
                         and p.error[j] <= p.error[o]]
                if out[o]:  # left out: some kept option is no worse in all three
                    assert beats, f"seed {seed}: option {o} left out with no kept option as good"
                else:  # kept: no other kept option is as good in all three (exact copies keep the first)
                    assert not beats, f"seed {seed}: option {o} kept though {beats} are as good"


@pytest.mark.parametrize("objective", ["time", "error"])
def test_leaving_them_out_changes_no_answer(objective):
    seed = random.getrandbits(32)
    rng = random.Random(seed)
    for trial in range(6):
        p = with_ties(rng, random_problem(rng, layers=rng.randint(2, 5), kinds_per_layer=rng.randint(2, 4)))
        pruned = Solver(p)
        whole = Solver(p)
        m = whole._model
        m.bounds = Bounds(m.bounds.lb, np.where(np.arange(m.nv) < m.n, 1.0, m.bounds.ub))  # every option offered
        low = pruned.smallest_budget()
        high = max(whole.solve(np.inf, "error").peak_bytes_per_stage)
        for budget in sorted({low, rng.uniform(low, high), high}):
            where = f"seed {seed} trial {trial} budget {budget}"
            try:
                a = pruned.solve(budget, objective)
            except InfeasibleBudget:
                with pytest.raises(InfeasibleBudget):
                    whole.solve(budget, objective)
                continue
            b = whole.solve(budget, objective)
            assert a.step_seconds == pytest.approx(b.step_seconds, rel=1e-6, abs=1e-9), where
            assert a.grad_error == pytest.approx(b.grad_error, rel=1e-6, abs=1e-9), where
            changed = [int(np.sum(~p.keeps_16bit()[x.chosen])) + int(x.checkpoint.sum()) for x in (a, b)]
            assert changed[0] == changed[1], where
            assert not dominated_options(p)[a.chosen].any(), where
