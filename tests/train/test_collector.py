"""agoq.train.collector: a trainer freezes what its first step left out of the cyclic collector and gives it back
when closed. Checked on llama-tiny (CPU), under checkpointing (its model sits in reference cycles): during the run
the model's parameters are frozen and a collection skips them; after close the model, dropped, is freed by the next
collection; with AGOQ_GC_FREEZE=0 nothing is frozen, and the losses are the same either way."""

import gc
import weakref

import pytest

from agoq.train import collector
from agoq.train.config import TrainConfig
from agoq.train.parallel import World
from agoq.train.preparation import prepare
from agoq.train.trainer import Trainer


def _trainer(seed: int) -> Trainer:
    cfg = TrainConfig(model="llama-tiny", device="cpu", dtype="fp32", seq_len=13, micro_batch=2, grad_accum=2,
                      steps=3, warmup=1, seed=seed, checkpoint_every=0, quiet=True, checkpoint_all=True)
    return Trainer(prepare(cfg, World()))


@pytest.fixture(autouse=True)
def _nothing_frozen_after():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_after_the_first_step_and_freed_after_close(monkeypatch):
    monkeypatch.delenv(collector.ENV, raising=False)
    trainer = _trainer(seed=7)
    assert gc.get_freeze_count() == 0
    first = trainer.step(0)
    assert gc.get_freeze_count() > 0  # the first step froze what it left
    model_ref = weakref.ref(trainer.prepared.model)
    frozen = gc.get_freeze_count()
    second = trainer.step(1)
    assert gc.get_freeze_count() <= frozen  # later steps freeze nothing more (frozen objects may die)
    assert all(r.loss == r.loss for r in (first, second))
    trainer.close()
    assert gc.get_freeze_count() == 0
    trainer.parallel.release()
    del trainer
    gc.collect()
    assert model_ref() is None  # nothing frozen keeps the dropped model alive


def test_off_switch_freezes_nothing_and_changes_no_loss(monkeypatch):
    monkeypatch.setenv(collector.ENV, "0")
    off = _trainer(seed=11)
    losses_off = [off.step(i).loss for i in range(3)]
    assert gc.get_freeze_count() == 0
    off.close()
    monkeypatch.delenv(collector.ENV)
    on = _trainer(seed=11)
    losses_on = [on.step(i).loss for i in range(3)]
    on.close()
    assert losses_on == losses_off


def test_hold_frees_each_measured_run_and_gives_everything_back(monkeypatch):
    """Inside collector.hold() (the profile's sequence of measured steps), the survivors of each collection are
    frozen, yet every run measured is freed once dropped, and leaving the hold unfreezes everything."""
    from agoq.train.measure import measure_steps

    monkeypatch.delenv(collector.ENV, raising=False)
    refs = []
    real_prepare = __import__("agoq.train.measure", fromlist=["prepare"]).prepare

    def keep_ref(cfg, world):
        prepared = real_prepare(cfg, world)
        refs.append(weakref.ref(prepared.model))
        return prepared

    monkeypatch.setattr("agoq.train.measure.prepare", keep_ref)
    cfg = dict(model="llama-tiny", device="cpu", dtype="fp32", seq_len=11, micro_batch=2, grad_accum=1, steps=2,
               warmup=1, checkpoint_every=0, quiet=True, checkpoint_all=True)
    with collector.hold():
        first = measure_steps(TrainConfig(**cfg, seed=3))
        assert gc.get_freeze_count() > 0  # the survivors of the release are frozen
        second = measure_steps(TrainConfig(**cfg, seed=3))
        assert all(ref() is None for ref in refs)  # each model, in reference cycles, was freed all the same
        frozen = gc.get_freeze_count()
        trainer = _trainer(seed=5)
        trainer.step(0)
        assert gc.get_freeze_count() <= frozen  # inside a hold the trainer freezes nothing of its own (frozen
        # objects may die)
        model_ref = weakref.ref(trainer.prepared.model)
        trainer.close()
        trainer.parallel.release()
        del trainer
        collector.collect()
        assert model_ref() is None
        cycle = _Node()
        cycle.other = _Node()
        cycle.other.other = cycle  # a cycle made inside the hold is still collected
        probe = weakref.ref(cycle.other)
        del cycle
        collector.collect()
        assert probe() is None
    assert gc.get_freeze_count() == 0
    assert first.losses == second.losses


class _Node:
    other = None
