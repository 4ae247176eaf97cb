"""Whether something keeps tensors alive: weak references to every tensor object made inside a block.

    with NewTensors() as made:
        session = open_something()
    session.close(); del session
    assert made.count > 0 and made.alive() == 0

A graph kept alive by anything (a tensor with a grad_fn, or only one of its nodes) keeps the tensors its
saved-tensor hooks packed alive too, so `alive()` counts it, where counting tensors with a grad_fn
before and after would not: a node alone holds no such tensor, and tensors freed meanwhile (caches of
earlier tests) could hide new ones.
"""

from __future__ import annotations

import gc
import weakref

import torch


def _tensors() -> list[torch.Tensor]:
    gc.collect()
    # type(), not isinstance(): isinstance reads __class__, which deprecated module objects warn about
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


class NewTensors:
    """The tensor objects that came into existence inside the `with` block (weakly referenced)."""

    def __enter__(self) -> "NewTensors":
        self._before = _tensors()  # held until __exit__, so that no new tensor can reuse one of their ids
        return self

    def __exit__(self, *exc) -> None:
        known = {id(t) for t in self._before}
        self._made = [weakref.ref(t) for t in _tensors() if id(t) not in known]
        self._before = None

    @property
    def count(self) -> int:
        return len(self._made)

    def alive(self) -> int:
        """How many of them are still alive after a full garbage collection."""
        gc.collect()
        return sum(1 for r in self._made if r() is not None)
