"""What a plan's predicted peak is made of (`predicted.memory_per_stage`, agoq.search.memory_parts): for every
gradient storage, layout, optimizer, masters and micro-batch split the search can choose on one-rank, pipelined
and two-rank profiles, at budgets from the least to the roomiest, the parts add up to each stage's predicted
peak, and the model state is the plan's own (its optimizer's moments, its masters, its layout's shards), checked
against the profile's memory section in closed form."""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest

from agoq.formats.plan import plan_from_dict
from agoq.formats.profile import load_profile
from agoq.models import build
from agoq.runtime.optim.state_bytes import state_table
from agoq.search.costs import build_problem
from agoq.search.knobs import KnobSpace, combinations
from agoq.search.memory_parts import whole_bytes
from agoq.search.milp import Allocation, Solver
from agoq.search.plan_builder import build_plan
from agoq.search.state import STATE_PARTS
from tests.search.synthetic_profile import write_profile

ALL = KnobSpace(masters=("fp32", "none"))  # every optimizer and masters combination the search may take


def _profile(folder, seed: int, step_sets_peaks: bool = False, **kw):
    """A llama-tiny profile with the fused step's state table (float32 masters of a bf16 model), calibrated with
    AdamW over float32 masters and bf16 gradients, a measured optimizer step and a LAAQ transient. The optimizer
    step's bytes beyond the state are small, or with `step_sets_peaks` halfway between what the least and the
    roomiest of the default knobs' choices hold at the end of forward beyond the state (so that it sets the peak
    of the least, not of the roomiest)."""
    rng = random.Random(seed)
    folder = write_profile(folder, rng, layer_forward=True, laaq_transient=rng.randrange(10**3, 10**4),
                           optimizer_step_bytes=rng.randrange(10**4, 10**5), **kw)
    header = json.loads((folder / "profile.json").read_text())
    m = build("llama-tiny", device="meta", num_layers=kw.get("num_layers"))
    header["memory"]["state"] = state_table([p.numel() for p in m.parameters()])
    header["memory"]["measured_with"] = {"optimizer": "adamw", "master": "fp32", "gradients": "bf16"}
    (folder / "profile.json").write_text(json.dumps(header))
    if step_sets_peaks:
        problem = build_problem(load_profile(folder))
        ends = [max(a.peak_bytes_per_stage) for _, a in _choices(problem, direct=True)]
        state = sum(v[0] for k, v in problem.static_parts.items() if k in STATE_PARTS)
        header["memory"]["fixed_bytes_optimizer_step"] = int((min(ends) + max(ends)) / 2 - state)
        (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    print("profiles seed", seed)
    root = tmp_path_factory.mktemp("memory")
    return {"one rank": _profile(root / "one", seed, micro_batch=2, seq_len=41),
            "pipeline": _profile(root / "pipe", seed + 1, num_layers=5, stages=2, in_flight=[2, 1], micro_batch=2,
                                 seq_len=23),
            "two ranks": _profile(root / "ranks", seed + 2, True, world_size=2, collectives=True,
                                  fsdp_collectives=True, micro_batch=2, seq_len=31)}


def _choices(problem, direct: bool = False):
    """Allocations to price: the MILP's at the least, a middle and the roomiest budget (unless `direct`), and
    every 2-bit option, every layer kept at 16 and every layer checkpointed."""
    out = []
    if not direct:
        solver = Solver(problem)
        low, high = solver.smallest_budget(), max(solver.solve(math.inf).peak_bytes_per_stage)
        out = [(b, solver.solve(b, "time")) for b in sorted({low, (low + high) // 2 + 3, high})]
    L = problem.num_layers
    two = [i for i, o in enumerate(problem.option) if o == "2"]
    for chosen, ckpt in [(np.array(two), np.zeros(L, dtype=bool)),
                         (np.nonzero(problem.keeps_16bit())[0], np.zeros(L, dtype=bool)),
                         (np.array([], dtype=int), np.ones(L, dtype=bool))]:
        f = problem.evaluate(chosen, ckpt)
        out.append((None, Allocation(chosen, ckpt, f["peak_bytes_per_stage"], f["step_seconds"], f["grad_error"],
                                     f["activation_bytes_per_stage"])))
    return out


def expected_state(profile, knobs, share: float) -> dict:
    """Weights, gradients, masters and optimizer state one rank of a stage keeps (docs/formats.md's closed form:
    replicated whole, FSDP2 1/N of all), from profile.json."""
    mem, world = profile.memory, profile.settings["world_size"]
    state = mem["state"]["optimizers"][f"{knobs.optimizer}/{knobs.master}"]
    layout = knobs.layout or ("fsdp" if knobs.gradient_mode == "sdp4bit" else "replicated")
    grads = mem["gradients_bytes_quangrad8"] if knobs.gradient_mode == "quangrad8" else mem["gradients_bytes_bf16"]
    whole = {"weights": mem["weights_bytes"], "gradients": grads, "masters": state["masters"],
             "optimizer_state": state["moments"]}
    shards = {"replicated": (), "fsdp": tuple(whole)}[layout]
    return {k: v * share / (world if k in shards else 1) for k, v in whole.items()}


def fsdp_unsharded(profile, gradient_mode: str) -> float:
    """FSDP2's unsharded bytes in flight: bf16 weights of the root unit and two layers, one unit's gradients."""
    cfg = profile.model_config()
    C, H, Hkv, I = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or C // H
    layer = 2 * C * H * D + 2 * C * Hkv * D + 3 * C * I + 2 * C
    root = profile.header["model"]["parameters"] - profile.num_layers * layer
    return 2 * (root + 2 * layer) + {"bf16": 2, "sdp4bit": 4}[gradient_mode] * max(root, layer)


def test_parts_add_up_to_the_peak_for_every_choice(profiles):
    phases, layouts, optimizers = set(), set(), set()
    for name, profile in profiles.items():
        mem = profile.memory
        transient = {k: v["step_transient"] for k, v in mem["state"]["optimizers"].items()}
        for knobs in combinations(profile, ALL):
            problem = build_problem(profile, knobs)
            for budget, alloc in _choices(problem):
                plan = build_plan(profile, problem, alloc, knobs, budget, "milp", "time")
                plan = plan_from_dict(json.loads(json.dumps(plan.to_dict())))  # as written and read back
                stage_of = [lp.stage for lp in plan.layers]
                for s, entry in enumerate(plan.predicted.memory_per_stage):
                    where = (name, knobs, budget, s, entry.phase)
                    parts = entry.parts
                    assert sum(parts.values()) == plan.predicted.peak_bytes_per_stage[s], where
                    share = stage_of.count(s) / len(stage_of)
                    for part, want in expected_state(profile, knobs, share).items():
                        assert abs(parts[part] - want) <= 2, (where, part, parts[part], want)
                    floor = sum(expected_state(profile, knobs, share).values()) + share * (
                        mem["fixed_bytes_optimizer_step"] + transient[f"{knobs.optimizer}/{knobs.master}"]
                        - transient["adamw/fp32"])
                    if entry.phase == "optimizer_step":
                        assert set(parts) == {"weights", "gradients", "masters", "optimizer_state",
                                              "optimizer_step_workspace"}, where
                        assert abs(sum(parts.values()) - floor) <= 1, where
                        continue
                    assert sum(parts.values()) >= floor - 1, where  # the optimizer step does not set this peak
                    if knobs.layout == "fsdp":
                        assert abs(parts["fsdp_unsharded"] - fsdp_unsharded(profile, knobs.gradient_mode)) <= 2
                    else:
                        assert "fsdp_unsharded" not in parts
                    if knobs.gradient_mode == "quangrad8":  # the calibration step's bf16 gradients, in backward
                        assert abs(parts["backward_gradients"] - mem["gradients_bytes_bf16"] * share) <= 2, where
                    if entry.phase == "checkpoint_backward":
                        assert plan.layers[entry.layer].checkpoint and plan.layers[entry.layer].stage == s, where
                        assert parts["recomputed_layer"] > 0
                    else:
                        assert abs(parts["activations"] - plan.predicted.activation_bytes_per_stage[s]) <= 2, where
                phases.update((name, e.phase) for e in plan.predicted.memory_per_stage)
                layouts.add(knobs.layout)
                optimizers.add((knobs.optimizer, knobs.master))
    assert phases >= {("one rank", "forward_backward"), ("one rank", "checkpoint_backward"),
                      ("pipeline", "forward_backward"), ("pipeline", "checkpoint_backward"),
                      ("two ranks", "forward_backward"), ("two ranks", "optimizer_step")}
    assert layouts == {"replicated", "fsdp"}
    assert optimizers == {("adamw", "fp32"), ("adamw8bit", "fp32"), ("adamw8bit", "none")}


def test_whole_bytes_add_up_and_stay_within_a_byte():
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for _ in range(200):
        parts = {f"p{i}": rng.uniform(-1e6, 1e9) for i in range(rng.randrange(1, 13))}
        exact = sum(parts.values())
        total = math.ceil(exact - 1e-6)
        got = whole_bytes(parts, total)
        assert sum(got.values()) == total, seed
        assert all(abs(got[k] - v) < 2 for k, v in parts.items()), seed
