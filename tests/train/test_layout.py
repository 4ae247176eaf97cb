"""The parallel layout value (agoq.layout): the combinations of mode, processes, pipeline stages, node size,
gradient storage and optimizer flag it takes and refuses are exactly those `agoq train` took and refused when
each rule was a string comparison of its own (the reference below is that code, kept as it was), and its
derived figures are the ones the runtime used."""

import itertools

import pytest

from agoq.layout import (
    MODES,
    ParallelLayout,
    PlanLayout,
    check_options,
    launch_line,
    state_kind,
)
from agoq.train.config import ParallelConfig


def _reference(parallel, world, pipeline_stages, node_size, gradients, optimizer):
    """The mode or the message of `agoq train` before the layout value: ParallelConfig's own checks and mode_for,
    then prepare's gradient and optimizer-flag checks, as they were written."""
    if parallel is not None and parallel not in ("none", "ddp", "sharded", "fsdp", "pipeline"):
        return f"--parallel must be one of none, ddp, sharded, fsdp, pipeline, got {parallel!r}"
    if node_size is not None and parallel not in ("sharded", "fsdp"):
        return "--node-size is for --parallel sharded or fsdp (SDP4Bit's two-level gradient reduce-scatter)"
    if pipeline_stages is not None and parallel != "pipeline":
        return "--pipeline-stages is for --parallel pipeline"
    mode = parallel or ("none" if world == 1 else "ddp")
    if mode == "none" and world > 1:
        return f"--parallel none with {world} processes: choose ddp, sharded, fsdp or pipeline"
    if mode != "none" and world < 2:
        return (f"--parallel {mode} needs several processes: launch with torchrun --nproc-per-node N agoq train ... "
                f"--parallel {mode}")
    if mode == "pipeline" and pipeline_stages not in (None, world):
        return (f"--pipeline-stages {pipeline_stages} but {world} processes: run one process per stage (pipeline and "
                "data parallelism are not combined)")
    if gradients not in ("bf16", "quangrad8", "sdp4bit"):
        return f"gradient mode must be bf16, quangrad8 or sdp4bit, got {gradients!r}"
    if gradients == "sdp4bit" and mode not in ("sharded", "fsdp"):
        return ("gradient mode sdp4bit is sharded data parallelism: use --parallel sharded or fsdp under torchrun (or "
                "pass --gradients quangrad8 / bf16 to run it otherwise)")
    if mode == "sharded" and gradients == "quangrad8":
        return ("--parallel sharded reduces gradients with SDP4Bit (or exactly with --gradients bf16), not with "
                "QuanGrad: use --parallel ddp for quangrad8")
    if mode == "fsdp" and gradients == "quangrad8":
        return ("--parallel fsdp reduce-scatters gradients with FSDP2 (--gradients bf16) or SDP4Bit's TLq-HS "
                "(--gradients sdp4bit), not with QuanGrad: use --parallel ddp for quangrad8")
    if mode == "sharded" and optimizer == "adamw8bit":
        return ("--parallel sharded uses SDP4Bit's sharded AdamW (float32 master and 8-bit moments, 1/N per rank): "
                "--optimizer adamw8bit is for ddp, pipeline or one process")
    return mode


def _layout_value(parallel, world, pipeline_stages, node_size, gradients, optimizer):
    """The same through the layout value: the flags' part, its layout for `world` processes, then its rules."""
    try:
        layout = ParallelConfig(parallel=parallel, pipeline_stages=pipeline_stages, node_size=node_size).layout(world)
        layout.check_gradients(gradients)
    except ValueError as e:
        return str(e)
    return layout.mode


# the messages that name hsdp since it runs (the rules are the same)
SINCE_HSDP = [("none, ddp, sharded, fsdp, pipeline", "none, ddp, sharded, fsdp, hsdp, pipeline"),
              ("(SDP4Bit's two-level gradient reduce-scatter)", "(SDP4Bit's two-level gradient reduce-scatter) and "
               "hsdp (the ranks that shard, replicated across nodes)"),
              ]


# the messages that no longer offer agoq's own sharded mode since it was retired (the rules are the same)
SINCE_RETIRED = [("none, ddp, sharded, fsdp, hsdp, pipeline", "none, ddp, fsdp, hsdp, pipeline"),
                 ("--node-size is for --parallel sharded or fsdp", "--node-size is for --parallel fsdp"),
                 ("choose ddp, sharded, fsdp or pipeline", "choose ddp, fsdp, hsdp or pipeline"),
                 ("use --parallel sharded or fsdp under torchrun", "use --parallel fsdp or hsdp under torchrun")]


def _since_hsdp(want):
    want = _since_hsdp_only(want)
    for old, new in SINCE_RETIRED:
        want = want.replace(old, new)
    return want


def _since_hsdp_only(want):
    if want.endswith("(--gradients sdp4bit), not with QuanGrad: use --parallel ddp for quangrad8"):
        return want.replace("use --parallel ddp for", "use --parallel ddp, or hsdp (its 8-bit all-reduce across "
                            "nodes), for")
    for old, new in SINCE_HSDP[:2]:
        want = want.replace(old, new)
    return want


def test_every_combination_is_taken_or_refused_as_before():
    modes = [m for m in MODES if m != "hsdp"]  # new: its own test below; sharded (retired): its own test too
    cases = list(itertools.product([None, *modes, "tensor"], range(1, 5), [None, 1, 2, 3], [None, 2],
                                   ["bf16", "quangrad8", "sdp4bit", "fp8"], [None, "adamw", "adamw8bit"]))
    outcomes = {}
    for case in cases:
        want = _since_hsdp(_reference(*case))
        world, node_size = case[1], case[3]
        built = _reference(*case[:4], "bf16", None)  # the layout the flags make, before gradients and optimizer
        if built == "fsdp" and node_size is not None and world % node_size:
            # the one rule added since, by the layout's dims (agoq.parallel_dims): the ranks of a node divide the
            # world (SDP4Bit's two-level reduce-scatter refused it before, at its first collective)
            want = (f"parallel.ranks_per_node {node_size} does not divide the world's {world} ranks: give the ranks "
                    "of one node (all nodes alike)")
        assert _layout_value(*case) == want, case
        outcomes[want in MODES] = outcomes.get(want in MODES, 0) + 1
    assert outcomes[True] > 50 and outcomes[False] > 50  # the table holds both kinds


def test_hsdp_replicates_nodes_of_shards_and_runs_every_gradient_mode():
    """--parallel hsdp over W ranks in nodes of --node-size S: replicate W / S x shard S with FSDP2, every gradient
    storage (bf16 exact, quangrad8 and sdp4bit across nodes); refused without a node size, with one node (fsdp) or
    a node size that does not divide the world, and --weight-gather runs with it."""
    for world, node in ((4, 2), (6, 3), (6, 2), (3, 1), (8, 4)):
        layout = ParallelConfig(parallel="hsdp", node_size=node, weight_gather="int8").layout(world)
        dims = layout.dims
        assert (dims.replicate, dims.shard, dims.engine, dims.mode) == (world // node, node, "fsdp2", "hsdp")
        assert layout.data_ranks == world and layout.sharded and not layout.replicated
        assert layout.resume_state == "fsdp" and state_kind("hsdp") == "hsdp"  # resumes as fsdp; plans apart
        for gradients in ("bf16", "quangrad8", "sdp4bit"):
            layout.check_gradients(gradients)
        assert "--node-size" in launch_line("hsdp", world, "sdp4bit", node)
    with pytest.raises(ValueError, match="give the ranks of a node with --node-size"):
        ParallelConfig(parallel="hsdp").layout(4)
    with pytest.raises(ValueError, match="has no replicas: that is --parallel fsdp"):
        ParallelConfig(parallel="hsdp", node_size=4).layout(4)
    with pytest.raises(ValueError, match="does not divide the world's 6 ranks"):
        ParallelConfig(parallel="hsdp", node_size=4).layout(6)
    with pytest.raises(ValueError, match="--parallel hsdp needs several processes"):
        ParallelConfig(parallel="hsdp", node_size=1).layout(1)


def test_the_retired_sharded_mode_is_refused_with_what_to_run():
    """--parallel sharded (agoq's own SDP4Bit step, retired): refused by the flags' check, the layout value and the
    dims, each time naming the FSDP2 command that replaces it."""
    instead = "--parallel fsdp --gradients sdp4bit --weight-gather int4 --node-size 1"
    for make in (lambda: check_options("sharded"), lambda: ParallelLayout.of("sharded", 2),
                 lambda: ParallelConfig(parallel="sharded", node_size=1).layout(2),
                 lambda: launch_line("sharded", 2, "sdp4bit")):
        with pytest.raises(ValueError, match="own sharded path.*was retired") as e:
            make()
        assert instead in str(e.value)


@pytest.mark.parametrize("mode, world, gradients, ok", [
    ("none", 1, "bf16", True), ("none", 1, "quangrad8", True), ("none", 1, "sdp4bit", False),
    ("ddp", 3, "quangrad8", True), ("ddp", 3, "sdp4bit", False),
    ("fsdp", 2, "bf16", True), ("fsdp", 2, "sdp4bit", True), ("fsdp", 2, "quangrad8", False),
    ("pipeline", 4, "bf16", True), ("pipeline", 4, "quangrad8", True), ("pipeline", 4, "sdp4bit", False),
])
def test_gradient_storage_each_mode_runs(mode, world, gradients, ok):
    layout = ParallelLayout.of(mode, world)
    assert (gradients in layout.gradient_modes) is ok
    if ok:
        layout.check_gradients(gradients)
    else:
        with pytest.raises(ValueError, match="gradient"):
            layout.check_gradients(gradients)


@pytest.mark.parametrize("mode, world, replicated, sharded, pipelined, data_ranks, resume_state, kind", [
    ("none", 1, True, False, False, 1, "none or ddp (replicated)", "replicated"),
    ("ddp", 5, True, False, False, 5, "none or ddp (replicated)", "replicated"),
    ("fsdp", 7, False, True, False, 7, "fsdp", "sharded"),
    ("pipeline", 3, False, False, True, 1, "pipeline", "pipeline"),
])
def test_what_each_mode_means(mode, world, replicated, sharded, pipelined, data_ranks, resume_state, kind):
    layout = ParallelLayout.of(mode, world)
    assert (layout.replicated, layout.sharded, layout.pipelined) == (replicated, sharded, pipelined)
    assert layout.data_ranks == data_ranks and layout.resume_state == resume_state and state_kind(mode) == kind
    assert layout.pipeline_stages == (world if pipelined else 1)
    with pytest.raises(AttributeError):
        layout.mode = "ddp"  # a value: frozen


def test_the_default_mode_follows_the_processes_and_the_value_is_always_valid():
    assert ParallelLayout() == ParallelLayout.of(None, 1) == ParallelLayout("none", 1, 1, None)
    assert ParallelLayout.of(None, 4).mode == "ddp"
    for bad in [dict(mode="ddp", world_size=1), dict(mode="none", world_size=2), dict(mode="pipeline", world_size=3),
                dict(mode="ddp", world_size=2, pipeline_stages=2), dict(mode="ddp", world_size=2, node_size=2),
                dict(mode="tensor", world_size=2), dict(mode="none", world_size=0)]:
        with pytest.raises(ValueError):
            ParallelLayout(**bad)
    check_options(None)
    with pytest.raises(ValueError, match="--node-size"):
        check_options(None, node_size=1)


def test_a_plan_layout_fits_its_own_state_kind():
    for planned, run, fits in [("fsdp", "fsdp", True), ("fsdp", "ddp", False), ("pipeline", "pipeline", True),
                               ("pipeline", "ddp", False), ("fsdp", "none", False)]:
        assert PlanLayout(planned, 3).fits(run) is fits, (planned, run)


def test_launch_line():
    assert launch_line("none", 1) == "agoq train MODEL --plan PLAN.json"
    assert launch_line("ddp", 3) == "torchrun --nproc-per-node 3 -m agoq.train MODEL --plan PLAN.json --parallel ddp"
    assert launch_line("fsdp", "N", "sdp4bit").endswith("--nproc-per-node N -m agoq.train MODEL --plan PLAN.json "
                                                         "--parallel fsdp --gradients sdp4bit")
