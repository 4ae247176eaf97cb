"""Options the MILP leaves out where each layer takes its own setting (agoq.search.milp_model.dominated_options):
checked against their definition option by option, and the MILP's answers with them left out against the same
MILP with every option offered, for both objectives and the tie-break, on random problems with ties built in."""

import random
from dataclasses import replace

import numpy as np
import pytest

from agoq.search.milp import InfeasibleBudget, Solver
import agoq.search.milp_model as milp_model
import agoq.search.milp_rows as milp_rows
from agoq.search.milp_model import dominated_options
from tests.search.test_milp import random_problem


def with_ties(rng, p):
    """`p` with some options copied from another of their group (bytes, seconds and error equal, and for a source's
    option the error it brings each recompute: exact ties) or made no better than one (a dominated option), so that
    every branch of the rule is taken."""
    memory, seconds, error = p.memory.copy(), p.seconds.copy(), p.error.copy()
    pairs = {(int(r), int(b)): float(t) for (r, b), t in zip(*p.pairs())}
    for idx in p.groups().values():
        rest = [i for i in idx if p.option[i] != "16"]
        if len(rest) < 2 or rng.random() < 0.3:
            continue
        a, b = rng.sample(rest, 2)
        worse = rng.random() < 0.5
        memory[b] = memory[a] + (rng.randint(0, 5) if worse else 0)
        seconds[b] = seconds[a] + (rng.uniform(0, 0.1) if worse else 0.0)
        error[b] = error[a] + (rng.uniform(0, 0.01) if worse else 0.0)
        for r in {r for r, _ in pairs}:
            pairs.pop((r, b), None)
            if (r, a) in pairs:
                pairs[(r, b)] = pairs[(r, a)] + (rng.uniform(0, 0.01) if worse else 0.0)
    return replace(p, memory=memory, seconds=seconds, error=error,
                   pair_options=np.array(list(pairs), dtype=int).reshape(-1, 2),
                   pair_error=np.array(list(pairs.values()), float))


def error_range(p, o: int) -> tuple[float, float, dict]:
    """The least and the most error option `o` brings whatever the other kinds' choice (a recompute option: its own,
    and with its source's worst option), and {recompute option: the error o brings it} for a source's option."""
    brings = {int(b): {} for b in range(len(p.option))}
    most = {}
    for (r, b), t in zip(*p.pairs()):
        brings[int(b)][int(r)] = float(t)
        most[int(r)] = max(most.get(int(r), 0.0), float(t))
    return float(p.error[o]), float(p.error[o]) + most.get(o, 0.0), brings[o]


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
                low, _, carried = error_range(p, o)
                beats = [j for j in kept if j != o and p.memory[j] <= p.memory[o] and p.seconds[j] <= p.seconds[o]
                         and error_range(p, j)[1] <= low
                         and all(error_range(p, j)[2].get(r, 0.0) <= t for r, t in carried.items())
                         and all(t <= carried.get(r, 0.0) for r, t in error_range(p, j)[2].items())]
                if out[o]:  # left out: some kept option is no worse in all three
                    assert beats, f"seed {seed}: option {o} left out with no kept option as good"
                else:  # kept: no other kept option is as good in all three (exact copies keep the first)
                    assert not beats, f"seed {seed}: option {o} kept though {beats} are as good"


@pytest.mark.parametrize("objective", ["time", "error"])
def test_leaving_them_out_changes_no_answer(objective, monkeypatch):
    # the first objective proven optimal, not within its usual gap: two programs of one problem may each stop at
    # another choice within the gap (seen with pairs of options, whose variables the pruned program lacks)
    monkeypatch.setattr(milp_model, "FIRST_GAP", 1e-9)
    seed = random.getrandbits(32)
    rng = random.Random(seed)
    for trial in range(6):
        p = with_ties(rng, random_problem(rng, layers=rng.randint(2, 5), kinds_per_layer=rng.randint(2, 4)))
        pruned = Solver(p)
        with monkeypatch.context() as patch:  # every option offered (and every pair of options given its variable)
            patch.setattr(milp_rows, "dominated_options", lambda q: np.zeros(len(q.option), dtype=bool))
            whole = Solver(replace(p))  # another object: a problem's rows are built once, then kept
        assert whole._model.nq == len(p.pairs()[1]) and not (whole._model.bounds.ub[:whole._model.n] == 0).any()
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
