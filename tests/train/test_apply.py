"""apply_plan: the policy, checkpointing, compile, offload and parallel steps, each once and in that order, and a
model that trains as the policy-applied, checkpointed model does, with its policy-applied layers compiled."""

import dataclasses
import os

import pytest
import torch

import agoq.runtime.activations.compile as compile_module
from agoq.runtime.activations.checkpointing import apply_checkpointing as checkpoint_layers
from agoq.runtime.activations.laaq import apply_activation_policy
from agoq.runtime.activations.policy import KINDS, RECOMPUTABLE, ActivationPolicy
from agoq.layout import ParallelLayout
from agoq.parallel_dims import ParallelDims
from agoq.models import build
from agoq.train import apply
from agoq.train.apply import Placement, apply_plan, remove_plan
from agoq.train.config import JobConfig, ModelConfig
from agoq.train.data import BatchShape
from agoq.train.parallel import World
from agoq.train.plan_settings import Offload, RunSpec

STEPS = ["policy", "checkpointing", "compile", "offload", "parallel"]


def _seed():
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    return seed


def _random_policy(gen: torch.Generator, layers: int) -> ActivationPolicy:
    """Per layer and kind: a bit width 2..8, kept, or recomputed where the kind can be."""
    def setting(kind):
        choices = [2, 3, 4, 5, 8, 16] + (["recompute"] if kind in RECOMPUTABLE else [])
        return choices[int(torch.randint(len(choices), (1,), generator=gen))]
    return ActivationPolicy(layers={i: {k: setting(k) for k in KINDS} for i in range(layers)})


def _run(compile_mode=None, offload=(), host_budget_bytes=None, shape=BatchShape(19, 3, 1)) -> RunSpec:
    """A one-process run's settings (bf16 gradients, AdamW with float32 masters) compiled in `compile_mode` (None:
    eager), offloading decoder layers `offload`."""
    cfg = JobConfig(model=ModelConfig(compile=compile_mode is not None, compile_mode=compile_mode or "default"))
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer="adamw", master="fp32"))
    return RunSpec(cfg, ParallelLayout(), "bf16", shape, Offload(tuple(offload), host_budget_bytes))


def _place() -> Placement:
    return Placement(World(), torch.device("cpu"), torch.float32)


def test_each_step_once_in_order(monkeypatch):
    calls = []

    def record(name, result=None):
        def step(model, **kwargs):
            calls.append((name, model, kwargs))
            return result
        return step

    hook = object()
    strategy = object()
    monkeypatch.setattr(apply, "apply_policy", record("policy"))
    monkeypatch.setattr(apply, "apply_checkpointing", record("checkpointing"))
    monkeypatch.setattr(apply, "apply_offload", record("offload"))
    monkeypatch.setattr(apply, "apply_compile", record("compile", hook))
    monkeypatch.setattr(apply, "apply_parallel", record("parallel", strategy))
    model, policy = torch.nn.Linear(2, 2), ActivationPolicy()
    applied = apply_plan(model, policy=policy, checkpoint=[1], run=_run("default", [0], 7), place=_place())
    assert [c[0] for c in calls] == STEPS and all(c[1] is model for c in calls)
    kwargs = {name: kw for name, _, kw in calls}
    assert kwargs["policy"] == {"policy": policy} and kwargs["checkpointing"] == {"layers": [1]}
    assert kwargs["compile"] == {"mode": "default", "memory_budget": None}
    assert kwargs["offload"] == {"layers": (0,), "host_budget_bytes": 7}
    assert kwargs["parallel"]["dims"] == ParallelDims() and kwargs["parallel"]["shape"].micro_batch == 3
    assert (kwargs["parallel"]["optimizer"], kwargs["parallel"]["master"]) == ("adamw", "fp32")
    assert applied.strategy is strategy and applied.before_micro_batch is hook


def test_the_parallel_step_applies_one_function_per_dimension(monkeypatch):
    """apply_parallel reads the run's dims, not a mode: pipeline stages -> apply_pipeline; a sharded state (FSDP2,
    with replicas HSDP) -> apply_shard with those dims; replicas (or one rank) -> apply_replicate; dims
    that do not make the world are refused before anything is applied."""
    calls = []
    for name in ("apply_pipeline", "apply_shard", "apply_replicate"):
        monkeypatch.setattr(apply, name, lambda model, _name=name, **kw: calls.append((_name, kw)) or _name)
    model = torch.nn.Linear(2, 2)
    cases = [(ParallelDims(), "apply_replicate"), (ParallelDims(replicate=4), "apply_replicate"),
             (ParallelDims(shard=4, engine="fsdp2"), "apply_shard"),
             (ParallelDims(replicate=2, shard=3, engine="fsdp2"), "apply_shard"),
             (ParallelDims(pipeline=4), "apply_pipeline")]
    for dims, want in cases:
        got = apply.apply_parallel(model, dims=dims, world=World(0, dims.world_size), device=torch.device("cpu"),
                                   gradients="bf16", dtype=torch.float32, shape=BatchShape(8, 1, 4),
                                   layer_stage=[0, 1, 2, 3])
        assert got == want and calls[-1][0] == want, dims
        if want == "apply_shard":
            assert calls[-1][1]["dims"] is dims
    with pytest.raises(ValueError, match="the world has 3"):
        apply.apply_parallel(model, dims=ParallelDims(replicate=2, shard=2, engine="fsdp2"), world=World(0, 3),
                             device=torch.device("cpu"), gradients="bf16", dtype=torch.float32,
                             shape=BatchShape(8, 1, 1))
    assert len(calls) == len(cases)


def test_the_compiled_layers_are_the_policy_applied_ones(monkeypatch):
    """A random policy with one layer checkpointed, compiled (aot_eager: Inductor's cold CPU compile would take
    most of a minute) in one process: every decoder layer is compiled, holds the policy's settings (and the
    checkpoint), and the loss and gradients equal those of the same weights under the eager policy and
    checkpointing; they differ from the plain model's."""
    seed = _seed()
    real = compile_module.compile_decoder_layers
    compiled = []
    monkeypatch.setattr(apply, "compile_decoder_layers",
                        lambda model, mode=None: compiled.append(real(model, mode=mode, backend="aot_eager")))
    gen = torch.Generator().manual_seed(seed)
    layers = 4
    policy = _random_policy(gen, layers)
    policy.layers[0] = {k: 4 for k in KINDS}  # at least one layer quantized: the policy changes the gradients
    checkpointed = [int(torch.randint(1, layers, (1,), generator=gen))]
    policy.layers[checkpointed[0]] = {k: 16 for k in KINDS}  # a checkpointed layer keeps its kinds (as in a plan)
    model = build("llama-tiny", num_layers=layers, seed=seed % 2**31)
    reference = build("llama-tiny", num_layers=layers, seed=seed % 2**31)
    plain = build("llama-tiny", num_layers=layers, seed=seed % 2**31)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=gen)

    applied = apply_plan(model, policy=policy, checkpoint=checkpointed, run=_run("default"), place=_place())
    assert compiled == [layers] and applied.strategy.module is model
    for i, layer in enumerate(model.model.layers):
        assert layer._compiled_call_impl is not None, i
        assert getattr(layer, "_agoq_checkpointed", False) is (i in checkpointed), i
        if not policy.keeps_everything(i):
            assert layer._agoq_settings == policy.settings(i), i
    apply_activation_policy(reference, policy)
    checkpoint_layers(reference, checkpointed)

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        loss = m(ids[:, :-1], ids[:, 1:])
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    loss, grads = loss_and_grads(model)
    loss_ref, grads_ref = loss_and_grads(reference)
    loss_plain, grads_plain = loss_and_grads(plain)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6, msg=f"seed {seed}")
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6, msg=f"seed {seed}: {name}")
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(grads[down], grads_plain[down])


def test_apply_without_compile_or_parallel_and_remove():
    """Only the activation steps: no strategy, nothing to call per micro-batch, nothing compiled; applying again
    replaces (it does not stack) and remove_plan gives every layer its own forward back."""
    model = build("llama-tiny")
    policy = ActivationPolicy(default={k: 8 for k in KINDS})
    for _ in range(2):
        applied = apply_plan(model, policy=policy, checkpoint=[0, 2])
        assert applied.strategy is None and applied.before_micro_batch() is None
    layers = model.model.layers
    assert [getattr(layer, "_agoq_checkpointed", False) for layer in layers] == [True, False, True]
    assert all(layer._compiled_call_impl is None for layer in layers)
    apply_plan(model, policy=None)
    assert all("forward" not in layer.__dict__ for layer in layers)
    apply_plan(model, policy=policy, checkpoint=[1])
    remove_plan(model)
    assert all("forward" not in layer.__dict__ for layer in layers)


@pytest.mark.parametrize("checkpoint", [[], [1]])
def test_offload_no_layer_changes_nothing(checkpoint):
    model = build("llama-tiny")
    apply_plan(model, policy=ActivationPolicy(default={k: 4 for k in KINDS}), checkpoint=checkpoint)
    before = {i: dict(layer.__dict__) for i, layer in enumerate(model.model.layers)}
    assert apply.apply_offload(model, layers=[]) is None
    assert {i: dict(layer.__dict__) for i, layer in enumerate(model.model.layers)} == before


@pytest.mark.parametrize("checkpoint", [[], [1]])
def test_offloaded_plan_trains_as_the_kept_one(checkpoint):
    """Offload copies what the layers keep and brings it back: the same loss and gradients, micro-batch after
    micro-batch (the loop's before_micro_batch empties the host pool between them)."""
    gen = torch.Generator().manual_seed(_seed())
    policy = _random_policy(gen, 2)
    # 8 x 600 tokens: a hidden-size tensor at 2 bits (8 x 599 x 64 / 4 bytes) is past MIN_BYTES, whatever the policy
    batches = [torch.randint(0, 256, (8, 600), generator=gen) for _ in range(3)]
    results = []
    for offload in ([], [0, 1]):
        torch.manual_seed(5)
        model = build("llama-tiny", num_layers=2)
        applied = apply_plan(model, policy=policy, checkpoint=checkpoint, run=_run(offload=offload))
        assert (applied.offload is None) == (not offload)
        got = []
        for ids in batches:
            applied.before_micro_batch()
            model.zero_grad(set_to_none=True)
            loss = model(ids, ids)
            loss.backward()
            got.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        results.append(got)
        if offload:
            assert applied.offload.stats.micro_batches == 2 and applied.offload.stats.offloaded_tensors > 0
    for a, b in zip(*results):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
