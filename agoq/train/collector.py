"""Python's cyclic garbage collector during training: what the first step built is frozen out of its view.

A full (generation 2) collection traverses every object the collector tracks, and the collector runs one whenever
enough objects have survived its younger collections; a step's autograd hooks, saved-tensor hooks and offload
copies make many. After the first step the process holds what compilation left (FX graphs, guards, generated
code: hundreds of thousands of objects), the model and the optimizer's state, none of which a step frees. So after
the first step (compilation, first allocations) `freeze_after_warmup` collects once and calls `gc.freeze()`: every
object then alive moves to the permanent generation, which collections skip. Later collections traverse only what
later steps make, and cyclic garbage made by steps is collected as before. `thaw` (the trainer done: its model and
optimizer may sit in reference cycles) moves them back, so the next collection can free them.

Measured on one H200 (the probe): the profile's measured steps spent about 1.2 s per kind of step collecting between
kinds, a full traversal of what earlier compilations left, and 0.45 s with the trainer freezing (16 kinds x 2
passes: 113.6 s, then 94.3; `experiments/results/profile_steps_cost*.json`). A tight-budget plan's step (compiled,
QuanGrad, micro-batch 1 x 2, 8 layers offloaded), 60 steps, did not move beyond its run-to-run spread: 155.9 and
136.8 ms frozen, 149.4 and 144.4 ms not (`train_gc_probe_10.2GB.json`). Whether it runs is the same in `agoq train`
and in the steps `agoq profile` measures (both step through agoq.train.trainer.Trainer), so the prices the search
learns from those steps hold for the runs.

Several trainers in one process (the kinds of step `agoq profile` measures, agoq.train.measure.measure_steps) each
collect the one before away: a full collection per kind, and with the trainer's own freeze undone at its close every
one of them traverses the whole heap (about 0.37 s on one H200's host: 136 of them, 50.5 s of a 434 s profile,
`experiments/results/profile_time_before.json`). Inside `hold()`, `collect` freezes what survives each collection:
the next ones traverse only what came after. A trainer inside a hold does not freeze after its first step: undoing
that freeze at its close would give the collector the whole heap back, and the next collection, which frees the
trainer, would traverse all of it (one such per kind: 26.5 s of a 288 s profile, `profile_time_after.json`). So
what a trainer makes stays with the collector, the collection after it frees it without traversing the frozen
rest, and its steps' collections traverse only what came after the hold's last freeze (the process's imports and
earlier kinds' leftovers stay frozen). Leaving the hold gives everything back to the collector.

AGOQ_GC_FREEZE=0 leaves the collector alone (to compare).
"""

from __future__ import annotations

import contextlib
import gc
import os

ENV = "AGOQ_GC_FREEZE"
_holds = 0  # nested hold() contexts now open


def enabled() -> bool:
    """Whether freezing is on (AGOQ_GC_FREEZE unset or not "0")."""
    return os.environ.get(ENV, "1").strip() != "0"


def freeze_after_warmup() -> bool:
    """Collect, then freeze every object alive now (after the first step); returns whether it froze. Inside a
    `hold()` it does neither (module docstring)."""
    if not enabled() or _holds:
        return False
    gc.collect()
    gc.freeze()
    return True


def collect() -> None:
    """A full collection; inside `hold()` (and with freezing on) what survives it is frozen, so that later
    collections skip it."""
    gc.collect()
    if _holds and enabled():
        gc.freeze()


@contextlib.contextmanager
def hold():
    """While open, `collect` freezes what survives it (module docstring); on leaving the outermost hold every frozen
    object goes back to the collector."""
    global _holds
    _holds += 1
    try:
        yield
    finally:
        _holds -= 1
        if not _holds and enabled():
            gc.unfreeze()


def thaw() -> None:
    """Give every frozen object back to the collector (the oldest generation): the next collection may free them."""
    gc.unfreeze()


__all__ = ["freeze_after_warmup", "thaw", "collect", "hold", "enabled", "ENV"]
