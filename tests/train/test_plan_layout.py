"""A plan whose layout needs a number of processes (a pipeline's stages, fsdp over the profile's
ranks) trains only in that many, and is refused elsewhere with the command that launches it; replicated plans
run in any number (agoq.layout)."""

import json
import os
import random

import pytest

from agoq.cli import main
from agoq.formats.plan import load_plan, plan_from_dict
from agoq.models import build, fingerprint
from agoq.search.plan_builder import launch_for
from agoq.layout import check_plan_world, plan_layout

LAYERS = 3  # llama-tiny


def _seed():
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    return random.Random(seed)


def _plan(tmp_path, *, stages=1, gradients="bf16", launch=None, name="plan.json"):
    """A llama-tiny plan of `stages` pipeline stages with `launch` (None: no launch section, as in 1.0 plans)."""
    model = build("llama-tiny")
    cut = [min(stages - 1, i * stages // LAYERS) for i in range(LAYERS)]
    data = {"schema": "agoq.plan/1.1", "model": {"name": model.config.name, "fingerprint": fingerprint(model)},
            "layers": [{"layer": i, "stage": cut[i], "kinds": {"silu_input": 4}} for i in range(LAYERS)],
            "gradients": {"mode": gradients}, "pipeline": {"stages": stages, "micro_batches": 2 * stages},
            "training": {"micro_batch": 2, "seq_len": 17, "grad_accum": 1}}
    if launch is not None:
        data["launch"] = launch
    plan_from_dict(data)  # valid
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _train(plan, out, *flags):
    return main(["train", "llama-tiny", "--plan", str(plan), "--steps", "1", "--eval-batches", "1", "--quiet",
                 "--device", "cpu", "--out", str(out), *flags])


def test_a_searched_fsdp_plan_of_several_ranks_is_refused_in_one_process(tmp_path, capsys):
    """The plan `agoq search` (and the dashboard's slider, the same search) makes on a several-rank profile with
    layout fsdp and bf16 gradients: one process refuses it (its per-rank peak holds for the shards), naming the
    torchrun command with this model and plan filled in."""
    from agoq.formats.profile import load_profile
    from agoq.search.knobs import KnobSpace, budget_bounds
    from tests.search.synthetic_profile import write_profile

    ranks = _seed().randint(2, 5)
    folder = write_profile(tmp_path / "profile", random.Random(ranks), world_size=ranks, collectives=True,
                           fsdp_collectives=True, link_bytes_per_second=1e11, layer_forward=True)
    _, largest = budget_bounds(load_profile(folder), KnobSpace(layouts=("fsdp",), gradient_modes=("bf16",)))
    plan = tmp_path / "search" / "plan.json"
    assert main(["search", "--profile", str(folder), "--budget", str(largest), "--layout", "fsdp", "--gradients",
                 "bf16", "--quiet", "--front-budgets", "0", "--out", str(plan)]) == 0
    searched = json.loads(plan.read_text())
    assert searched["launch"]["parallel"] == "fsdp" and searched["gradients"]["mode"] == "bf16"
    capsys.readouterr()
    out = tmp_path / "run"
    assert _train(plan, out) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert f"fsdp over {ranks} processes" in err and "this run has 1 process" in err, err
    assert f"torchrun --nproc-per-node {ranks} -m agoq.train llama-tiny --plan {plan} --parallel fsdp" in err, err
    assert not (out / "run.json").exists()


def test_a_plan_of_the_retired_sharded_step_is_refused_with_what_to_run(tmp_path, capsys):
    """sdp4bit gradients without a layout (a 1.0 plan): agoq's retired own sharded step, refused (exit 2) saying
    what runs instead; nothing is written."""
    plan = _plan(tmp_path, gradients="sdp4bit")
    assert _train(plan, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "own sharded path" in err and "retired" in err, err
    assert "--parallel fsdp --gradients sdp4bit --weight-gather int4 --node-size 1" in err, err
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.parametrize("layout", ["tlq-hs", "fsdp", "pipeline"])
def test_every_layout_that_needs_its_processes_is_refused_in_one(tmp_path, capsys, layout):
    rng = _seed()
    if layout == "pipeline":
        n = rng.randint(2, LAYERS)
        plan, parallel = _plan(tmp_path, stages=n, launch=launch_for(n, "bf16", 1)), "pipeline"
    else:
        n = rng.randint(2, 9)
        gradients = "sdp4bit" if layout == "tlq-hs" else rng.choice(["bf16", "sdp4bit"])
        plan, parallel = _plan(tmp_path, gradients=gradients, launch=launch_for(1, gradients, n, "fsdp")), "fsdp"
    assert _train(plan, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert f"torchrun --nproc-per-node {n} -m agoq.train llama-tiny --plan {plan} --parallel {parallel}" in err, err
    assert "this run has 1 process" in err and not (tmp_path / "run" / "run.json").exists()


def test_the_world_size_rule(tmp_path):
    """Refused exactly where the number of processes (or, once decided, the parallel mode) differs from the
    layout's; replicated plans and plans without a layout pass at every size."""
    rng = _seed()
    n = rng.randint(2, 7)
    plans = {"tlq-hs": load_plan(_plan(tmp_path, gradients="sdp4bit", launch=launch_for(1, "sdp4bit", n),
                                        name="s.json")),
             "fsdp": load_plan(_plan(tmp_path, launch=launch_for(1, "bf16", n, "fsdp"), name="f.json")),
             "pipeline": load_plan(_plan(tmp_path, stages=LAYERS, launch=launch_for(LAYERS, "bf16", 1),
                                         name="p.json"))}
    for name, plan in plans.items():
        needed = plan_layout(plan).processes
        assert needed == (LAYERS if name == "pipeline" else n)
        for size in range(1, 10):
            if size == needed:
                check_plan_world(plan, size, None, "m", "p.json")
            else:
                with pytest.raises(ValueError, match=f"this run has {size} process"):
                    check_plan_world(plan, size, None, "m", "p.json")
    check_plan_world(plans["tlq-hs"], n, "fsdp", "m", "p.json")  # sdp4bit gradients: FSDP2 with TLq-HS
    with pytest.raises(ValueError, match=f"this run has {n} processes, --parallel ddp"):
        check_plan_world(plans["fsdp"], n, "ddp", "m", "p.json")
    with pytest.raises(ValueError, match="--parallel ddp"):
        check_plan_world(plans["pipeline"], LAYERS, "ddp", "m", "p.json")
    replicated = load_plan(_plan(tmp_path, gradients="quangrad8", launch=launch_for(1, "quangrad8", n),
                                 name="r.json"))
    plain = load_plan(_plan(tmp_path, name="plain.json"))
    assert plan_layout(replicated) is None and plan_layout(plain) is None
    for size in range(1, 10):
        check_plan_world(replicated, size, "ddp" if size > 1 else "none", "m", "r.json")
        check_plan_world(plain, size, None, "m", "plain.json")


def test_a_replicated_plan_of_several_ranks_trains_in_one_process(tmp_path):
    plan = _plan(tmp_path, gradients="quangrad8", launch=launch_for(1, "quangrad8", _seed().randint(2, 8)))
    assert _train(plan, tmp_path / "run") == 0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["settings"]["parallel"] == "none"
