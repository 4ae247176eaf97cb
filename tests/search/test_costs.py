"""Cost models against independent references: the bytes autograd really keeps for a plan's choice on
llama-tiny, closed-form stage memory and step time, micro-batch / block rescaling against a profile written
at the new size, and the profile reader's errors."""

import dataclasses
import itertools
import json
import math
import random

import numpy as np
import pandas as pd
import pytest
import torch

import agoq
from agoq.runtime.activations.policy import RECOMPUTABLE
from agoq.train.apply import apply_plan, remove_plan
from agoq.formats.profile import load_profile
from agoq.models import build
from agoq.search import costs
from agoq.search.costs import (
    ProblemSettings,
    build_problem,
    checkpointing_only,
    state_parts,
    static_bytes_total,
)
from agoq.search.milp import Solver
from agoq.search.search import plan_from_profile
from tests.search.synthetic_profile import write_profile
from tests.search.test_milp import random_problem


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def test_predicted_activation_bytes_equal_measured(tmp_path):
    """Plans at budgets across the whole range (checkpointed layers, all-16 layers, shared o_proj input,
    quantized kinds): the predicted activation bytes equal what track_saved_tensors measures."""
    seed, rng = fresh_rng()
    mb, seq = rng.choice([1, 2, 3]), rng.choice([19, 37, 50])
    folder = write_profile(tmp_path / "p", rng, micro_batch=mb, seq_len=seq, num_layers=4)
    profile = load_profile(folder)
    problem = build_problem(profile)
    solver = Solver(problem)
    low = solver.smallest_budget()
    high = max(solver.solve(math.inf).peak_bytes_per_stage)
    model = build(profile.header["model"]["spec"], dtype=torch.bfloat16, num_layers=4, seed=seed % 2**31)
    ids = torch.randint(0, model.config.vocab_size, (mb, seq + 1), generator=torch.Generator().manual_seed(seed))
    seen = set()
    for frac in (0.0, 0.1, 0.3, 0.6, 1.0, rng.random()):
        budget = int(low + frac * (high - low))
        for cap in (None, "checkpoint"):
            plan = plan_from_profile(profile, budget, objective="error", time_cap=cap, error_cap=None,
                                     knobs=ProblemSettings())
            apply_plan(model, policy=plan.activation_policy(), checkpoint=plan.checkpoint_layers())
            with agoq.track_saved_tensors(model) as log:
                loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            model.zero_grad(set_to_none=True)
            remove_plan(model)
            measured = sum(log.layer_total(i) for i in range(4))
            assert plan.predicted.activation_bytes_per_stage == [measured], \
                f"seed {seed} budget {budget}: {[lp.model_dump() for lp in plan.layers]}"
            assert max(plan.predicted.peak_bytes_per_stage) <= budget
            seen.add((tuple(plan.checkpoint_layers()), tuple(str(plan.settings(i)) for i in range(4))))
    assert len(seen) >= 3, "the budgets did not produce different plans"


def test_stage_memory_and_time_closed_form(tmp_path):
    """evaluate() of a random choice == a pandas computation straight from the profile's rows."""
    seed, rng = fresh_rng()
    stages = rng.choice([2, 3])
    in_flight = [rng.randint(1, 6) for _ in range(stages)]
    folder = write_profile(tmp_path / "p", rng, num_layers=6, stages=stages, in_flight=in_flight,
                           collectives=True, world_size=2, layer_forward=True,
                           optimizer_step_bytes=rng.randrange(10**5, 3 * 10**6),
                           laaq_transient=rng.randrange(10**4, 10**5))
    profile = load_profile(folder)
    mode = rng.choice(["bf16", "quangrad8"])  # (sdp4bit gradients run under FSDP2: one pipeline stage only)
    problem = build_problem(profile, ProblemSettings(gradient_mode=mode, grad_accum=2))
    table = profile.table
    header = profile.header
    L = 6
    # a random choice, with at least one layer quantized everywhere (no all-16 or sharing correction)
    chosen, ckpt = [], np.zeros(L, dtype=bool)
    ckpt[rng.randrange(1, L)] = True
    expected_layer = np.zeros(6)  # bytes each layer keeps, x its stage's in-flight micro-batches
    expected_err = 0.0
    layer_stage = header["pipeline"]["layer_stage"]
    for (l, k), idx in problem.groups().items():
        if ckpt[l]:
            continue
        quantized = [i for i in idx if problem.option[i] not in ("16", "recompute")]
        i = rng.choice(quantized) if l == 0 else rng.choice(list(idx))
        chosen.append(i)
    sixteen_layers = set()
    for l in range(L):
        mine = [i for i in chosen if problem.layer[i] == l]
        if mine and all(problem.option[i] == "16" for i in mine):
            sixteen_layers.add(l)
    shares = set()
    for l in range(L):
        opts = {agoq.KINDS[problem.kind[i]]: problem.option[i] for i in chosen if problem.layer[i] == l}
        if opts and opts["attention"] == "16" and opts["o_proj_input"] == "16":
            shares.add(l)
    for i in chosen:
        l, kind, opt = int(problem.layer[i]), agoq.KINDS[problem.kind[i]], problem.option[i]
        row = table[(table.layer == l) & (table.kind == kind) & (table.option == opt)].iloc[0]
        nbytes = row["bytes_unshared"] if not (kind == "o_proj_input" and l in shares) else 0
        expected_layer[l] += in_flight[layer_stage[l]] * nbytes
        if opt != "recompute":
            expected_err += row["sensitivity"]
            continue
        # recompute is exact from a 16-bit source; from one at b bits it counts the kind's own row at b bits
        source = {problem.option[j] for j in chosen if problem.layer[j] == l
                  and agoq.KINDS[problem.kind[j]] == RECOMPUTABLE[kind]}.pop()
        if source != "16":
            expected_err += table[(table.layer == l) & (table.kind == kind) & (table.option == source)].iloc[0][
                "sensitivity"]
    from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
    from agoq.models import resolve_config
    shape = LayerShape.from_config(resolve_config(header["model"]["config"]), 2, header["settings"]["seq_len"])
    plain = sum(predict_layer_bytes(shape, None).values())
    for l in sixteen_layers:
        laaq16 = table[(table.layer == l) & (table.option == "16")]["bytes_unshared"].sum()
        o16 = table[(table.layer == l) & (table.option == "16") & (table.kind == "o_proj_input")]["bytes_unshared"].sum()
        expected_layer[l] += in_flight[layer_stage[l]] * (plain - (laaq16 - o16 * (l in shares)))
    hidden = header["model"]["config"]["hidden_size"]
    for l in np.nonzero(ckpt)[0]:
        expected_layer[l] += in_flight[layer_stage[l]] * 2 * header["settings"]["seq_len"] * hidden * 2
    counts = np.bincount(layer_stage, minlength=stages)
    static = static_bytes_total(profile, mode) * counts / L + header["memory"]["fixed_bytes"] \
        + header["memory"]["outside_activation_bytes"]
    if mode == "quangrad8":  # the fixed bytes were calibrated on bf16 gradients, which backward still makes while
        # QuanGrad's buffer exists: both count at the fwd + bwd peak
        static = static + state_parts(profile, "bf16")["gradients"] * counts / L
    if mode == "bf16":  # two micro-batches: the first one's gradients are kept through the second's fwd + bwd
        static = static + state_parts(profile, "bf16")["gradients"] * counts / L
    activations = np.bincount(layer_stage, weights=expected_layer, minlength=stages)
    # a stage with a layer under LAAQ's functions (neither all 16 nor checkpointed) holds the transient
    paper = next(st for st in header["memory"]["steps"] if st["policy"] == "agoq-paper")
    transient = paper["measured_peak_bytes_forward_backward"] - paper["predicted_peak_bytes_forward_backward"]
    laaq_layers = {int(problem.layer[i]) for i in chosen if problem.option[i] != "16"}
    static = static + np.array([transient * any(layer_stage[l] == s for l in laaq_layers) for s in range(stages)])
    expected_mem = static + activations
    # the backward of a checkpointed layer comes after the LM head's tensors are freed; with two micro-batches (or
    # QuanGrad's buffer, or SDP4Bit's) the gradients are in the static bytes already (the measured miss of that phase
    # is the calibration's, and this profile measured no compiled steps)
    cfg = header["model"]["config"]
    from agoq.models.step_peak import head_peak_bytes, head_shape_of
    head = head_shape_of(header["memory"], cfg, header["settings"]["micro_batch"], header["settings"]["seq_len"], 2)
    end_of_backward = -(head_peak_bytes(head) if head is not None else 0)
    for l in np.nonzero(ckpt)[0]:  # its backward: other micro-batches, earlier layers, its input + rerun forward
        s = layer_stage[l]
        n = in_flight[s]
        earlier = sum(expected_layer[j] for j in range(l) if layer_stage[j] == s)
        during = static[s] + (n - 1) / n * activations[s] + earlier / n + expected_layer[l] / n + plain \
            + end_of_backward
        expected_mem[s] = max(expected_mem[s], during)
    floor = (static_bytes_total(profile, mode) + header["memory"]["fixed_bytes_optimizer_step"]) \
        * counts / L
    expected_mem = np.maximum(expected_mem, floor)  # the optimizer step's peak
    coll = pd.read_parquet(folder / "collectives.parquet")
    path = {"bf16": "nccl-bf16", "quangrad8": "quangrad8", "sdp4bit": "sdp4bit"}[mode]
    per_byte = coll[coll.path == path]["seconds"].iloc[0] / coll[coll.path == path]["message_bytes"].iloc[0]
    comm = per_byte * header["model"]["parameters"] * 4  # the fixture's times are linear in size
    # step seconds from the measured steps at 2 x 2 (bf16 gradients and the base optimizer; QuanGrad's gradients add
    # what its measured step at that split added): the bf16 step, dQ per layer under LAAQ (the agoq-paper step's
    # extra seconds: its options have no seconds of their own), dC per checkpointed layer
    steps = {(r["policy"], r["gradients"], r["optimizer"], r["master"]): r["step_seconds"]
             for r in header["measured_steps"]["rows"] if (r["micro_batch"], r["grad_accum"]) == (2, 2)}
    bf16 = steps[("bf16", "bf16", "adamw8bit", "fp32")]
    base = steps[("bf16", "quangrad8", "adamw8bit", "fp32")] if mode == "quangrad8" else bf16
    d_laaq = (steps[("agoq-paper", "bf16", "adamw8bit", "fp32")] - bf16) / L
    d_ckpt = (steps[("checkpoint-all", "bf16", "adamw8bit", "fp32")] - bf16) / L
    expected_seconds = base + len(laaq_layers) * d_laaq + int(ckpt.sum()) * d_ckpt + comm
    got = problem.evaluate(np.array(chosen), ckpt)
    np.testing.assert_allclose(got["peak_bytes_per_stage"], expected_mem, rtol=0, atol=1, err_msg=f"seed {seed}")
    assert got["step_seconds"] == pytest.approx(expected_seconds, rel=1e-9), f"seed {seed}"
    assert got["grad_error"] == pytest.approx(expected_err, rel=1e-12), f"seed {seed}"


def test_micro_batch_and_block_rescaling_match_a_fresh_profile(tmp_path):
    seed, rng = fresh_rng()
    seq = rng.choice([17, 33])
    mb_new, block_new = rng.choice([1, 3, 4]), rng.choice([32, 64, 256])
    a = load_profile(write_profile(tmp_path / "a", random.Random(seed), micro_batch=12, seq_len=seq))
    b = load_profile(write_profile(tmp_path / "b", random.Random(seed), micro_batch=mb_new, seq_len=seq, block=block_new))
    pa = build_problem(a, ProblemSettings(micro_batch=mb_new, block=block_new))
    pb = build_problem(b)
    assert pa.option == pb.option
    np.testing.assert_allclose(pa.memory, pb.memory, rtol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(pa.unmodified_extra, pb.unmodified_extra, rtol=1e-12)
    np.testing.assert_allclose(pa.shared_credit, pb.shared_credit, rtol=1e-12)
    np.testing.assert_allclose(pa.checkpoint_memory, pb.checkpoint_memory, rtol=1e-12)


def test_floor_bits_and_checkpointing_only(tmp_path):
    seed, rng = fresh_rng()
    profile = load_profile(write_profile(tmp_path / "p", rng))
    floors = {"silu_input": 5, "attention": 8}
    p = build_problem(profile, ProblemSettings(floor_bits=tuple(floors.items())))
    for kind, floor in floors.items():
        opts = {p.option[i] for i in range(len(p.option)) if agoq.KINDS[p.kind[i]] == kind}
        assert all(o == "16" or int(o) >= floor for o in opts) and "16" in opts
    only = checkpointing_only(p)
    assert set(only.option) == {"16"}
    alloc = Solver(only).solve(math.inf, "time")
    assert not alloc.checkpoint.any()
    low = Solver(only).smallest_budget()
    # the least memory is the least peak over every set of checkpointed layers (brute force)
    L = len(alloc.checkpoint)
    keep = np.nonzero(only.keeps_16bit())[0]
    peaks = {}
    for mask in itertools.product([False, True], repeat=L):
        ck = np.array(mask)
        chosen = np.array([i for i in keep if not ck[only.layer[i]]], dtype=int)
        peaks[mask] = max(only.evaluate(chosen, ck)["peak_bytes_per_stage"])
    assert low == pytest.approx(min(peaks.values()), abs=1)
    got = Solver(only).solve(low).checkpoint
    assert peaks[tuple(bool(c) for c in got)] == pytest.approx(min(peaks.values()), abs=1)


@pytest.mark.parametrize("damage,match", [
    ("schema", "schema"), ("newer", "newer"), ("no_parquet", "profile.parquet"), ("column", "missing column"),
    ("negative", "bytes"), ("kind", "unknown kind"), ("recompute", "cannot be recomputed"), ("layers", "layer"),
    ("no_option", "option: 1 row"), ("no_kind", "kind: 1 row"),
])
def test_profile_reader_errors(tmp_path, damage, match):
    folder = write_profile(tmp_path / "p", random.Random(1), num_layers=2)
    header = json.loads((folder / "profile.json").read_text())
    table = pd.read_parquet(folder / "profile.parquet")
    if damage == "schema":
        header["schema"] = "agoq.plan/1"
    elif damage == "newer":
        header["schema"] = "agoq.profile/2"
    elif damage == "no_parquet":
        (folder / "profile.parquet").unlink()
    elif damage == "column":
        table = table.drop(columns=["sensitivity"])
    elif damage == "negative":
        table.loc[3, "bytes"] = -1
    elif damage == "kind":
        table.loc[0, "kind"] = "gate"
    elif damage == "recompute":
        table.loc[table.option == "recompute", "kind"] = "attention"
    elif damage == "layers":
        header["model"]["num_layers"] = 3
    elif damage in ("no_option", "no_kind"):  # a cell without a value (NaN on pandas 3, "nan" text on 2)
        column = damage[3:]
        values = table[column].astype(object)
        values[5] = None
        table[column] = values
    (folder / "profile.json").write_text(json.dumps(header))
    if damage != "no_parquet":
        table.to_parquet(folder / "profile.parquet")
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_profile(folder)


def test_recipe_error_is_the_published_recipe_summed_from_the_table(tmp_path):
    """recipe_error == the agoq-paper settings at the stage rule's bits, summed straight from the rows: each stored
    kind's row at its bits, and each recomputed kind (rebuilt from its source at those bits) its own row at them."""
    from agoq.search.costs import recipe_error

    seed, rng = fresh_rng()
    stages = rng.choice([1, 2, 3])
    in_flight = sorted((rng.randint(1, 7) for _ in range(stages)), reverse=True)
    folder = write_profile(tmp_path / "p", rng, num_layers=rng.choice([5, 7]), stages=stages, in_flight=in_flight,
                           bits=tuple(range(2, 9)))  # every width the stage rule can ask for (4..8)
    profile = load_profile(folder)
    stage_of = profile.layer_stage()
    bits = [min(8, max(4, (4 * in_flight[0]) // n)) for n in in_flight]  # the stage rule, by hand
    total = 0.0
    for row in pd.read_parquet(folder / "profile.parquet").itertuples():
        b = str(bits[stage_of[row.layer]])
        # recompute is exact from a 16-bit source, whatever the profile read for it; from a source at b bits it counts
        # the kind's own row at b bits (agoq.profiler.additivity)
        want = {"norm_input": b, "o_proj_input": b, "silu_input": b, "attention": "16"}.get(row.kind, b)
        if row.option == want and row.format in ("int", "bf16"):
            total += row.sensitivity
    assert recipe_error(build_problem(profile)) == pytest.approx(total, rel=1e-12), (seed, in_flight)


def test_recompute_adds_no_error_whatever_the_profile_measured(tmp_path):
    """A recompute option rebuilds its tensor exactly: its error is 0 although the profile's rows (like a GPU
    profile's, which read the floor of two nondeterministic reruns) say otherwise; every other option's error is its
    row's sensitivity."""
    seed, rng = fresh_rng()
    folder = write_profile(tmp_path / "p", rng, num_layers=rng.choice([3, 5]), bits=(8, 4, 3))
    table = pd.read_parquet(folder / "profile.parquet")
    assert (table.loc[table.option == "recompute", "sensitivity"] > 0).any(), seed  # the test can fail
    problem = build_problem(load_profile(folder))
    want = {(int(r.layer), r.kind, str(r.option)): (0.0 if r.option == "recompute" else r.sensitivity)
            for r in table.itertuples()}
    from agoq.runtime.activations.policy import KINDS

    got = {(int(l), KINDS[k], o): e for l, k, o, e in zip(problem.layer, problem.kind, problem.option, problem.error)}
    assert got.keys() <= want.keys() and any(o == "recompute" for _, _, o in got), seed
    for key, e in got.items():
        assert e == pytest.approx(want[key], rel=1e-12, abs=0.0), (seed, key)


def test_recipe_cap_needs_the_recipes_widths(tmp_path):
    from agoq.search.costs import recipe_error
    from agoq.search.milp import resolve_error_cap

    seed, rng = fresh_rng()
    problem = build_problem(load_profile(write_profile(tmp_path / "p", rng, num_layers=3, bits=(8, 6, 3))))
    assert recipe_error(problem) is None
    with pytest.raises(ValueError, match="recipe"):
        resolve_error_cap(problem, "recipe")
    assert resolve_error_cap(problem, 0.25) == 0.25


def test_a_profile_of_the_older_loss_says_so(tmp_path, seed):
    """A profile whose chunked head recorded more than today's head peak (the loss that copied each chunk's weight
    gradient to float32) makes the search say how many bytes its compiled plans may be predicted high; a profile that
    recorded today's peak says nothing."""
    from agoq.models.step_peak import head_peak_bytes, head_shape_of

    rng = random.Random(seed)
    profile = load_profile(write_profile(tmp_path / "p", rng, num_layers=3))
    header = profile.header
    head = head_shape_of(header["memory"], header["model"]["config"], header["settings"]["micro_batch"],
                         header["settings"]["seq_len"], 2)
    extra = rng.randrange(1, 10**7)
    for recorded, said in ((head_peak_bytes(head), None), (head_peak_bytes(head) + extra, extra)):
        header["memory"]["chunked_lm_head"] = {**head.as_dict(), "peak_bytes": recorded}
        profile.cache.clear()
        notes = [n for n in build_problem(profile).notes if "LM loss held" in n]
        assert notes == ([] if said is None else [notes[0]]) and (said is None or f"held {said} bytes" in notes[0])


def _same_problem(a, b) -> bool:
    """Field by field equal (arrays by value, dicts of arrays too)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys() or not all(np.array_equal(x[k], y[k]) for k in x):
                return False
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


def test_problems_built_once_per_knobs_equal_a_fresh_build_and_read_only(tmp_path, monkeypatch):
    """build_problem keeps what it built in the profile's cache: the same object for the same knobs, equal to a
    build from a freshly loaded profile, its arrays read-only; knobs the profile cannot price raise a fresh error
    each time; a profile keeps only the last KEEP_PROBLEMS."""
    seed, rng = fresh_rng()
    folder = write_profile(tmp_path / "p", rng, num_layers=rng.randint(2, 5), micro_batch=2)
    profile = load_profile(folder)
    knobs = [ProblemSettings(), ProblemSettings(gradient_mode="quangrad8"), ProblemSettings(optimizer="adamw8bit"),
             ProblemSettings(allow_checkpoint=False), ProblemSettings(micro_batch=1)]
    rng.shuffle(knobs)
    for k in knobs:
        first = build_problem(profile, k)
        assert build_problem(profile, k) is first, f"seed {seed}: {k} built again"
        assert _same_problem(first, build_problem(load_profile(folder), k)), f"seed {seed}: {k} kept differs"
        with pytest.raises(ValueError, match="read-only"):
            first.memory[0] += 1.0
    unpriced = ProblemSettings(micro_batch=rng.choice([5, 7, 9]))
    errors = []
    for _ in range(2):
        with pytest.raises(ValueError, match="measured no") as raised:
            build_problem(profile, unpriced)
        errors.append(raised.value)
    assert errors[0] is not errors[1] and str(errors[0]) == str(errors[1])
    monkeypatch.setattr(costs, "KEEP_PROBLEMS", 3)
    again = load_profile(folder)
    kept = [build_problem(again, k) for k in knobs]
    assert len(again.cache["problems"]) == 3
    assert build_problem(again, knobs[-1]) is kept[-1], f"seed {seed}: the last built is kept"
    assert build_problem(again, knobs[0]) is not kept[0], f"seed {seed}: the first built is dropped"


def test_rows_and_checkpointing_twin_made_once_and_again_when_a_field_changes():
    """A problem's MILP rows and its checkpointing-only twin are made once (ChoiceProblem.derived) and shared by its
    solvers; reassigning a field makes them again, and the answers equal those of a fresh copy of the problem."""
    seed, rng = fresh_rng()
    p = random_problem(rng, layers=rng.randint(2, 5), kinds_per_layer=rng.randint(2, 4))
    a, b = Solver(p), Solver(p)
    assert a._model.time_row is b._model.time_row and a._model.structure is b._model.structure
    assert checkpointing_only(p) is checkpointing_only(p)
    twin = checkpointing_only(p)
    p.seconds = p.seconds * rng.uniform(1.5, 3.0)  # reassigned: what was derived from the old seconds is stale
    c = Solver(p)
    assert c._model.time_row is not a._model.time_row and checkpointing_only(p) is not twin
    fresh = Solver(dataclasses.replace(p))
    low = fresh.smallest_budget()
    high = max(fresh.solve(math.inf, "time").peak_bytes_per_stage)
    budget = rng.uniform(low, high)
    for objective in ("time", "error"):
        mine, theirs = c.solve(budget, objective), fresh.solve(budget, objective)
        assert mine.step_seconds == pytest.approx(theirs.step_seconds, rel=1e-6), f"seed {seed} {objective}"
        assert mine.grad_error == pytest.approx(theirs.grad_error, rel=1e-6, abs=1e-12), f"seed {seed} {objective}"
