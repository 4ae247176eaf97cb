"""The data-parallel layout knob: FSDP2's per-rank memory and step time in closed form, and the search choosing
FSDP2 where only it fits and DDP where collectives are slow (agoq.search.layouts)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from agoq.formats.plan import load_plan
from agoq.formats.profile import load_profile
from agoq.search.costs import ProblemSettings, build_problem, static_bytes_total
from agoq.search.knobs import KnobSpace, budget_bounds, combinations, solve_knobs
from agoq.search.plan_builder import build_plan, launch_for
from tests.search.synthetic_profile import write_profile


def _profile(tmp_path, world_size: int, link: float, seed: int = 11, **kw):
    """A llama-tiny profile of `world_size` ranks with FSDP2's collectives over a link of `link` bytes/s, its bf16
    step 0.05 s of which 0.0123 s is the optimizer step, and float32 masters of 4 bytes per parameter."""
    folder = write_profile(tmp_path / f"p{world_size}", random.Random(seed), world_size=world_size, collectives=True,
                           fsdp_collectives=True, link_bytes_per_second=link, layer_forward=True, **kw)
    header = json.loads((folder / "profile.json").read_text())
    header["memory"]["master_bytes"] = 4 * header["model"]["parameters"]
    header["memory"]["steps"][0]["optimizer_step_seconds"] = 0.0123
    (folder / "profile.json").write_text(json.dumps(header))
    return load_profile(folder)


def _table_seconds(table, op, path, message_bytes):
    """Log-log interpolation of the measured rows (the documented reading of the collectives table)."""
    rows = table[(table["op"] == op) & (table["path"] == path)].sort_values("message_bytes")
    xs, ys = np.log(rows["message_bytes"].to_numpy(float)), np.log(rows["seconds"].to_numpy(float))
    assert xs[0] < math.log(message_bytes) < xs[-1]  # inside the measured sizes: no extrapolation here
    return float(np.exp(np.interp(math.log(message_bytes), xs, ys)))


def test_fsdp_memory_and_step_time_in_closed_form(tmp_path):
    world, accum = 3, 3
    p = _profile(tmp_path, world, link=1.3e7)
    cfg = p.model_config()
    C, H, Hkv, I = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or C // H
    L, P = p.num_layers, p.header["model"]["parameters"]
    layer = 2 * C * H * D + 2 * C * Hkv * D + 3 * C * I + 2 * C  # q, o; k, v; gate, up, down; two norms
    root = P - L * layer
    assert root > 0 and layer > 0

    knobs = ProblemSettings(gradient_mode="bf16", layout="fsdp", optimizer="adamw", master="fp32", micro_batch=2,
                            grad_accum=accum)
    fsdp = build_problem(p, knobs)
    ddp = build_problem(p, ProblemSettings(gradient_mode="bf16", layout="replicated", optimizer="adamw",
                                           master="fp32", micro_batch=2, grad_accum=accum))
    mem = p.memory
    sharded = (2 * P + 2 * P + 4 * P + mem["optimizer_bytes_adamw"]) / world
    in_flight = 2 * (root + 2 * layer) + 2 * max(root, layer)
    # head + workspace: ddp's static bytes less its state and the gradients its 3 micro-batches accumulate
    rest = float(ddp.static_bytes[0]) - static_bytes_total(p, "bf16", "adamw", "fp32") - 2 * P
    accumulated = 2 * P / world  # FSDP2 reduce-scatters each micro-batch's gradients: what accumulates is a shard
    assert fsdp.static_bytes[0] == pytest.approx(sharded + in_flight + rest + accumulated, rel=1e-12)
    assert fsdp.static_bytes[0] < ddp.static_bytes[0]

    table = p.collectives
    ag_l = _table_seconds(table, "all_gather", "nccl-bf16", 4 * layer)
    rs_l = _table_seconds(table, "reduce_scatter", "nccl-bf16", 4 * layer)
    ag_r = _table_seconds(table, "all_gather", "nccl-bf16", 4 * root)
    rs_r = _table_seconds(table, "reduce_scatter", "nccl-bf16", 4 * root)
    # the measured steps of one and two micro-batches of 2 (the base optimizer's, moved to AdamW by what its
    # measured step at the profiled split added): one more micro-batch's seconds and the rest of the step
    rows = {(r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"], r["optimizer"], r["master"]):
            r["step_seconds"] for r in p.header["measured_steps"]["rows"]}
    base = rows[("bf16", 2, 1, "bf16", "adamw8bit", "fp32")]
    adamw = rows[("bf16", 2, 1, "bf16", "adamw", "fp32")] - base
    one, two = base + adamw, rows[("bf16", 2, 2, "bf16", "adamw8bit", "fp32")] + adamw
    fb, once = two - one, 2 * one - two
    fwd, bwd = fb / (3 * L), 2 * fb / (3 * L)
    assert ag_l > fwd and ag_l + rs_l > bwd  # this link leaves some of every layer's communication exposed
    exposed = L * ((ag_l - fwd) + (ag_l + rs_l - bwd)) + 2 * ag_r + rs_r
    assert fsdp.base_seconds == pytest.approx(accum * fb + once / world + accum * exposed, rel=1e-9)


def test_the_search_picks_fsdp_where_only_fsdp_fits(tmp_path):
    p = _profile(tmp_path, 4, link=1e11, seed=5)
    space_ddp, space_fsdp = KnobSpace(layouts=("replicated",)), KnobSpace(layouts=("fsdp",))
    ddp_least, _ = budget_bounds(p, space_ddp)
    fsdp_least, _ = budget_bounds(p, space_fsdp)
    assert fsdp_least < ddp_least
    budget = (fsdp_least + ddp_least) // 2 + 7
    found = solve_knobs(p, budget, space=KnobSpace(layouts=("replicated", "fsdp")))
    best = found.best
    assert best.knobs.layout == "fsdp"
    assert max(best.alloc.peak_bytes_per_stage) <= budget
    assert any(r.knobs.layout == "replicated" and r.alloc is None for r in found.tried)  # DDP was tried, not fitting
    plan = build_plan(p, best.problem, best.alloc, best.knobs, budget, "milp", "time")
    launch = plan.to_dict()["launch"]
    assert launch["parallel"] == "fsdp" and launch["processes"] == 4
    assert "--nproc-per-node 4" in launch["command"] and "--parallel fsdp" in launch["command"]
    path = tmp_path / "plan.json"
    plan.save(path)
    from agoq.train.parallel import World
    from agoq.layout import plan_parallel_default

    assert plan_parallel_default(load_plan(path), World(size=4)) == "fsdp"


def test_slow_collectives_and_a_generous_budget_pick_ddp(tmp_path):
    p = _profile(tmp_path, 2, link=2.9e6, seed=7)
    _, largest = budget_bounds(p)
    # bf16 gradients: FSDP2 moves 3x the weights' bf16 bytes per micro-batch, DDP 2x once per step (with TLq-HS
    # and the int4 gather FSDP2 moves less than DDP's all-reduce, and may be picked on any link)
    bf16 = KnobSpace(gradient_modes=("bf16",))
    found = solve_knobs(p, 3 * largest + 13, space=bf16)
    assert found.best.knobs.layout == "replicated"
    fsdp = [r for r in found.tried if r.knobs.layout == "fsdp"]
    assert fsdp  # priced, and slower
    assert all(r.alloc is None or r.alloc.step_seconds > found.best.alloc.step_seconds for r in fsdp)
    # the same profile over a fast link: FSDP2's communication hides under compute and its optimizer step is 1/N
    fast = _profile(tmp_path / "fast", 2, link=1e13, seed=7)
    assert solve_knobs(fast, 3 * largest + 13, space=bf16).best.knobs.layout == "fsdp"


def test_the_retired_sharded_layout_is_refused_naming_fsdp(tmp_path, capsys):
    """`agoq search --layout sharded` (agoq's retired own layout): argparse's usage error (exit 2), before the
    profile is read, naming `--layout fsdp`; the dashboard's request rule and the cost model refuse it too; a
    two-rank profile offers sdp4bit gradients under fsdp only, a one-rank profile or one without FSDP2's timings not
    at all, saying why."""
    from agoq.cli import main
    from agoq.search.request import BadField, read_field

    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as e:
        main(["search", "--profile", str(tmp_path / "none"), "--budget", "1GiB", "--out", str(out), "--layout",
              "sharded"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "retired" in err and "--layout fsdp" in err and "Traceback" not in err, err
    assert not out.exists()
    with pytest.raises(BadField, match="retired.*layout fsdp"):
        read_field("layout", "sharded")
    two = load_profile(write_profile(tmp_path / "two", random.Random(3), world_size=2, collectives=True,
                                     fsdp_collectives=True))
    with pytest.raises(ValueError, match="own sharded path.*was retired"):
        build_problem(two, ProblemSettings(gradient_mode="sdp4bit", layout="sharded"))
    assert {k.layout for k in combinations(two, KnobSpace(gradient_modes=("sdp4bit",)))} == {"fsdp"}
    one = load_profile(write_profile(tmp_path / "one", random.Random(3), world_size=1))
    with pytest.raises(ValueError, match=r"no gradient storage of \('sdp4bit',\) has figures"):
        combinations(one, KnobSpace(gradient_modes=("sdp4bit",)))
    bare = load_profile(write_profile(tmp_path / "bare", random.Random(3), world_size=2, collectives=True))
    with pytest.raises(ValueError, match="sdp4bit have no layout on this profile.*FSDP2.*reduce-scatter timings"):
        combinations(bare, KnobSpace(gradient_modes=("sdp4bit",)))


def test_layouts_offered_and_refused(tmp_path):
    one = load_profile(write_profile(tmp_path / "one", random.Random(1), world_size=1))
    assert {k.layout for k in combinations(one)} == {"replicated"}
    with pytest.raises(ValueError, match="layout fsdp shards over several ranks"):
        build_problem(one, ProblemSettings(layout="fsdp"))
    # several ranks but no all-gather / reduce-scatter timings: fsdp is not offered, and asked for it says why
    bare = load_profile(write_profile(tmp_path / "bare", random.Random(1), world_size=2, collectives=True))
    assert "fsdp" not in {k.layout for k in combinations(bare)}
    with pytest.raises(ValueError, match="all_gather nccl-bf16, reduce_scatter nccl-bf16"):
        build_problem(bare, ProblemSettings(layout="fsdp"))
    with pytest.raises(ValueError, match="no layout of fsdp is possible"):
        combinations(bare, KnobSpace(layouts=("fsdp",)))
    with pytest.raises(ValueError, match="layout fsdp runs gradient mode"):
        build_problem(bare, ProblemSettings(gradient_mode="quangrad8", layout="fsdp"))
    piped = load_profile(write_profile(tmp_path / "piped", random.Random(1), world_size=2, stages=2,
                                       collectives=True, fsdp_collectives=True))
    assert "fsdp" not in {k.layout for k in combinations(piped)}
    with pytest.raises(ValueError, match="one pipeline stage, the plan has 2 stages"):
        build_problem(piped, ProblemSettings(layout="fsdp"))
    assert launch_for(1, "sdp4bit", 3, "fsdp")["command"].endswith("--parallel fsdp --gradients sdp4bit")
    assert launch_for(1, "sdp4bit", 3)["parallel"] == "fsdp"  # sdp4bit gradients: FSDP2 with TLq-HS (no layout given)
    with pytest.raises(ValueError, match="own sharded path.*was retired"):
        launch_for(1, "sdp4bit", 3, "sharded")
    assert launch_for(1, "bf16", 1)["parallel"] == "none" and launch_for(4, "bf16", 2)["parallel"] == "pipeline"


def test_optuna_trials_draw_layouts_and_keep_the_plans_other_knobs(tmp_path, seed):
    """Optuna's trials vary the layout too: one categorical over every layout the profile offers; a trial whose
    gradient storage cannot take the layout it drew runs its storage's own. Optimizer, masters and compile mode are
    the MILP plan's (`base`) wherever the layout allows them. Each trial's knobs are rebuilt from its parameters."""
    import optuna

    from agoq.search.costs import compile_modes, gradient_modes, optimizer_choices
    from agoq.search.layouts import layouts, resolve_layout
    from agoq.search.study import KnobSpace, knobs_from_trial, run_study

    p = _profile(tmp_path, 2, link=1e11, seed=seed % 1000)
    base = ProblemSettings(optimizer="adamw8bit", master="none", compile_mode=compile_modes(p)[-1])
    space = KnobSpace(p, base=base)
    offered = {m: layouts(2, p.collectives, m, 1) for m in gradient_modes(p)}
    assert space.layouts == sorted({lay for v in offered.values() for lay in v}) and "fsdp" in space.layouts
    for mode in gradient_modes(p):  # every (mode, layout drawn): the layout run is the one the mode allows
        for drawn in space.layouts:
            k = space.suggest(optuna.trial.FixedTrial({**space.defaults(), "gradient_mode": mode, "layout": drawn}))
            assert k.layout == (drawn if drawn in offered[mode] else offered[mode][0]), (seed, mode, drawn)
            assert (k.optimizer, k.master) == ((base.optimizer, base.master)
                                               if (base.optimizer, base.master) in optimizer_choices(mode, k.layout)
                                               else optimizer_choices(mode, k.layout)[0])
            assert k.compile_mode == base.compile_mode
    _, largest = budget_bounds(p)
    result = run_study(p, largest, storage=f"sqlite:///{tmp_path / 'study.db'}", trials=10, objective="time",
                       time_cap=None, base=base, progress=False, seed=seed)
    assert len(result.trials) == 10
    for r in result.trials:
        resolve_layout(r.knobs.layout, r.knobs.gradient_mode)  # a layout the storage takes
        trial = result.study.trials[r.number]
        assert knobs_from_trial(trial, space) == r.knobs, seed
        assert trial.distributions["layout"].choices == tuple(space.layouts)


def test_optuna_keeps_to_the_layouts_asked(tmp_path, seed):
    """`agoq search --layout replicated` (the demo's one-process search): no trial may come back sharded or fsdp,
    or the plan could not run in one process; asking for a layout no storage takes is a clear error."""
    from agoq.search.study import KnobSpace, run_study

    p = _profile(tmp_path, 2, link=1e11, seed=seed % 1000)
    _, largest = budget_bounds(p)
    result = run_study(p, largest, storage=f"sqlite:///{tmp_path / 'study.db'}", trials=8, objective="time",
                       time_cap=None, progress=False, seed=seed, layouts_allowed=("replicated",))
    assert result.trials and {r.knobs.layout for r in result.trials} == {"replicated"}, seed
    assert {r.knobs.gradient_mode for r in result.trials} <= {"bf16", "quangrad8"}
    with pytest.raises(ValueError, match="layout"):
        KnobSpace(p, layouts_allowed=("pipeline",))
