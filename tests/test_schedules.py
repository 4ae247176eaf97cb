"""Pipeline in-flight counts: the simulated schedules against closed forms and an independent timeline."""

import pytest

from agoq.profiler.profile import pipeline_summary
from agoq.schedules import in_flight, simulate, stage_order


def _timeline(stages, micro_batches, chunks):
    """Independent check: start time of every op by dynamic programming over the dependency graph
    (each op starts when its stage's previous op and its data dependencies have finished), then the
    in-flight count of each stage at every time unit by brute force over all (chunk, micro-batch) intervals."""
    orders = [stage_order(s, stages, micro_batches, chunks) for s in range(stages)]
    start = {}
    pieces = stages * chunks

    def piece_owner(p):
        return p % stages, p // stages

    changed = True
    pos = [0] * stages
    while changed:
        changed = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                kind, c, j = orders[s][pos[s]]
                p = c * stages + s
                deps = []
                if kind == "F" and p > 0:
                    deps.append((piece_owner(p - 1)[0], ("F", piece_owner(p - 1)[1], j)))
                if kind == "B":
                    deps.append((s, ("F", c, j)))
                    if p < pieces - 1:
                        deps.append((piece_owner(p + 1)[0], ("B", piece_owner(p + 1)[1], j)))
                if not all(d in start for d in deps):
                    break
                prev = start[(s, orders[s][pos[s] - 1])] + 1 if pos[s] else 0
                start[(s, orders[s][pos[s]])] = max([prev] + [start[d] + 1 for d in deps])
                pos[s] += 1
                changed = True
    assert all(pos[s] == len(orders[s]) for s in range(stages)), "the schedule deadlocks"
    makespan = max(start.values()) + 1
    peaks = []
    for s in range(stages):
        intervals = [(start[(s, ("F", c, j))], start[(s, ("B", c, j))]) for (_, c, j) in orders[s] if _ == "F"]
        peaks.append(max(sum(1 for a, b in intervals if a <= t <= b) for t in range(makespan)))
    return peaks, makespan


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 1), (2, 5), (3, 2), (3, 7), (4, 8), (5, 3), (7, 11)])
def test_1f1b_against_closed_form_and_timeline(stages, micro_batches):
    got = in_flight(stages, micro_batches)
    assert got == [min(stages - i, micro_batches) for i in range(stages)]
    peaks, makespan = _timeline(stages, micro_batches, 1)
    assert got == peaks
    # unit-time forwards and backwards: 1F1B finishes in 2 (M + P - 1) steps
    assert simulate(stages, micro_batches).makespan == makespan == 2 * (micro_batches + stages - 1)


@pytest.mark.parametrize("stages,micro_batches,chunks", [(2, 2, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2), (4, 4, 3),
                                                         (5, 10, 2)])
def test_interleaved_against_closed_form_and_timeline(stages, micro_batches, chunks):
    got = in_flight(stages, micro_batches, chunks)
    warmup = [(stages - 1 - i) * 2 + (chunks - 1) * stages for i in range(stages)]
    assert got == [min(micro_batches * chunks, w + 1) for w in warmup]
    assert got == _timeline(stages, micro_batches, chunks)[0]


def test_paper_counts_and_summary():
    assert in_flight(4, 8, 2) == [11, 9, 7, 5]  # 4 stages x 8 micro-batches, as reported for LAAQ
    summary = pipeline_summary(4, 8, 13)
    assert summary["in_flight"] == {"1f1b": [4, 3, 2, 1], "interleaved-1f1b": [11, 9, 7, 5]}
    assert summary["layer_stage"] == sorted(summary["layer_stage"]) and set(summary["layer_stage"]) == {0, 1, 2, 3}
    assert "interleaved-1f1b" not in pipeline_summary(3, 4, 12)["in_flight"]  # 4 is not a multiple of 3


def test_every_op_runs_once_and_interleaved_needs_whole_groups():
    sim = simulate(3, 6, 2)
    assert len(sim.finish) == 3 * 6 * 2 * 2
    with pytest.raises(ValueError, match="multiple"):
        stage_order(0, 3, 4, 2)
