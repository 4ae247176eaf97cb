"""In-flight activations per pipeline stage, from simulating the schedules themselves.

Each schedule is first written as the ordered list of operations every stage runs (as Megatron-LM
orders them), then executed by a dependency-driven simulation: a forward of micro-batch j on model
chunk c can run once chunk c-1 has run it (on the previous stage, or on the last stage for the
previous chunk), a backward once the next chunk has run its backward and this chunk its forward.
Every operation takes one time unit; a stage runs its next operation as soon as its inputs are
ready. The simulation fails loudly if the order would deadlock. A stage holds a (chunk,
micro-batch)'s activations from the start of its forward to the end of its backward; the peak count
over the run is what it must fit in memory.

- "1f1b": P stages, M micro-batches; stage i runs min(P - 1 - i, M) warm-up forwards, then one
  forward / one backward alternately, then the remaining backwards.
- "interleaved-1f1b": each stage holds v model chunks (layers cut into P * v pieces, chunk c of stage i
  holding piece c * P + i); micro-batches go in groups of P through chunk 0, then chunk 1, ...;
  stage i runs (P - 1 - i) * 2 + (v - 1) * P warm-up forwards. M must be a multiple of P.
  Counts are in (chunk, micro-batch) units, each 1/v of the stage's layers for one micro-batch:
  4 stages, 8 micro-batches, v = 2 gives 11, 9, 7, 5.
"""

from __future__ import annotations

from dataclasses import dataclass

Op = tuple[str, int, int]  # ("F" or "B", chunk, micro-batch)


def _chunk_of(k: int, stages: int, chunks: int, forward: bool) -> int:
    c = (k % (stages * chunks)) // stages
    return c if forward else chunks - 1 - c


def _micro_batch_of(k: int, stages: int, chunks: int) -> int:
    return (k // (stages * chunks)) * stages + k % stages


def stage_order(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Op]:
    """The operations stage `stage` runs, in order, under 1F1B (chunks=1) or interleaved 1F1B."""
    if stages < 1 or micro_batches < 1 or chunks < 1 or not 0 <= stage < stages:
        raise ValueError(f"bad pipeline: stage {stage} of {stages}, {micro_batches} micro-batches, {chunks} chunks")
    total = micro_batches * chunks
    if chunks == 1:
        warmup = min(stages - 1 - stage, micro_batches)
        fwd = [("F", 0, j) for j in range(micro_batches)]
        bwd = [("B", 0, j) for j in range(micro_batches)]
    else:
        if micro_batches % stages:
            raise ValueError(f"interleaved 1F1B needs the micro-batch count ({micro_batches}) to be a multiple of "
                             f"the stage count ({stages})")
        warmup = min((stages - 1 - stage) * 2 + (chunks - 1) * stages, total)
        fwd = [("F", _chunk_of(k, stages, chunks, True), _micro_batch_of(k, stages, chunks)) for k in range(total)]
        bwd = [("B", _chunk_of(k, stages, chunks, False), _micro_batch_of(k, stages, chunks)) for k in range(total)]
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    order += bwd[total - warmup:]
    return order


@dataclass
class Simulation:
    """Result of running a schedule: per stage the peak in-flight count, and the time step each op ended."""

    peak: list[int]
    finish: dict[tuple[int, Op], int]  # (stage, op) -> end time
    makespan: int


def simulate(stages: int, micro_batches: int, chunks: int = 1) -> Simulation:
    """Execute every stage's order under the data dependencies; raises RuntimeError on a deadlock."""
    orders = [stage_order(s, stages, micro_batches, chunks) for s in range(stages)]
    last_piece = stages * chunks - 1

    def piece(stage: int, chunk: int) -> int:
        return chunk * stages + stage

    def owner(p: int) -> tuple[int, int]:  # piece -> (stage, chunk)
        return p % stages, p // stages

    done: dict[tuple[int, Op], int] = {}
    pos, held, peak = [0] * stages, [0] * stages, [0] * stages
    t, remaining = 0, sum(len(o) for o in orders)
    while remaining:
        ready = []
        for s in range(stages):
            if pos[s] == len(orders[s]):
                continue
            kind, c, j = orders[s][pos[s]]
            p = piece(s, c)
            if kind == "F":
                deps = [] if p == 0 else [(*owner(p - 1), "F", j)]
            else:
                deps = [(s, c, "F", j)] + ([] if p == last_piece else [(*owner(p + 1), "B", j)])
            if all(done.get((ds, (dk, dc, dj)), t) < t for ds, dc, dk, dj in deps):
                ready.append(s)
        if not ready:
            raise RuntimeError(f"pipeline schedule deadlocks at time {t}: stages at {pos}")
        for s in ready:
            op = orders[s][pos[s]]
            if op[0] == "F":
                held[s] += 1
                peak[s] = max(peak[s], held[s])
            else:
                held[s] -= 1
            done[(s, op)] = t
            pos[s] += 1
            remaining -= 1
        t += 1
    return Simulation(peak, done, t)


def in_flight(stages: int, micro_batches: int, chunks: int = 1) -> list[int]:
    """Peak (chunk, micro-batch) activation sets each stage holds, from `simulate`."""
    return simulate(stages, micro_batches, chunks).peak
