"""The layout as dimensions (agoq.parallel_dims.ParallelDims): built only valid, checked against a world's ranks,
mapped to the search's layout words and the runtime's parallel modes; plans carry it (`parallel`, 1.8), older
plans' `launch` is read into the same dims, and a plan whose decision contradicts its dims is refused."""

import os
import random

import pytest

from agoq.parallel_dims import ParallelDims, launch_line, launch_of, plan_dims
from agoq.vocabulary import DDP, FSDP, HSDP, LAYOUTS, NONE, PARALLEL_MODES, PIPELINE, REPLICATED, SHARDED


def fresh_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    return seed, random.Random(seed)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _node(mode, world, rng):
    """A node size for `mode` over `world` ranks: hsdp's (a divisor below the world, so that it has replicas), else
    None (the mode needs none)."""
    return rng.choice([d for d in _divisors(world) if d < world]) if mode == HSDP else None


def test_dims_of_any_world_are_checked_against_it():
    """For random world sizes (powers of two or not): the dims of each layout and mode have that many ranks and
    validate against it; against any other world they are refused naming both counts."""
    seed, rng = fresh_rng()
    for _ in range(40):
        world = rng.randint(1, 97)
        for layout in LAYOUTS:
            if layout == HSDP and world == 1:  # replicas of shards need two ranks at least
                continue
            dims = ParallelDims.of_layout(layout, world, ranks_per_node=_node(layout, world, rng))
            assert dims.world_size == world and dims.validate(world) is dims, seed
            assert dims.layout == layout, seed
            assert dims.data_ranks == world, seed  # every rank of a replicated or sharded state reads its own data
            other = rng.choice([w for w in range(1, 2 * world + 3) if w != world])
            with pytest.raises(ValueError, match=rf"is {world} rank\(s\), the world has {other}"):
                dims.validate(other)
        stages = rng.randint(2, 9)
        pipe = ParallelDims.of_layout(REPLICATED, world, stages)
        assert (pipe.world_size, pipe.data_ranks, pipe.mode) == (stages, 1, PIPELINE), seed


def test_products_that_do_not_match_the_world_are_refused():
    """A grid replicate x shard x pipeline of random sizes validates only against its product."""
    seed, rng = fresh_rng()
    for _ in range(60):
        axis = rng.choice(["replicate", "shard", "pipeline"])
        n = rng.randint(1, 50)
        dims = ParallelDims(**{axis: n}, engine="fsdp2" if axis == "shard" else None)
        product = 1
        for name in ("replicate", "shard", "pipeline", "tensor"):
            product *= getattr(dims, name)
        assert dims.world_size == product == n, seed
        wrong = n + rng.randint(1, 20)
        with pytest.raises(ValueError, match="give dimensions whose product is"):
            dims.validate(wrong)


def test_what_does_not_run_is_refused_with_a_clear_message():
    """Tensor parallelism, shards without an engine, replicas of shards, pipelines with data parallelism, a
    non-positive or non-integer axis and ranks per node that do not divide the world: each refused saying so."""
    seed, rng = fresh_rng()
    n = rng.randint(2, 12)
    with pytest.raises(ValueError, match="tensor parallelism is not supported yet"):
        ParallelDims(tensor=n)
    with pytest.raises(ValueError, match="needs an engine"):
        ParallelDims(shard=n)
    with pytest.raises(ValueError, match=r"parallel.engine sdp4bit: agoq's own sharded path.*was retired.*"
                                         r"--parallel fsdp --gradients sdp4bit --weight-gather int4 --node-size 1"):
        ParallelDims(replicate=rng.randint(1, 4), shard=n, engine="sdp4bit")
    for retired in (lambda: ParallelDims.of_mode(SHARDED, n), lambda: ParallelDims.of_layout(SHARDED, n),
                    lambda: launch_line(SHARDED, n, "sdp4bit")):
        with pytest.raises(ValueError, match="own sharded path.*was retired"):
            retired()
    shard = rng.randint(1, 4)  # FSDP2's replicas of shards (HSDP) are dims; a node is its shard ranks
    hybrid = ParallelDims(replicate=n, shard=shard, engine="fsdp2")
    assert hybrid.hybrid and hybrid.mode == HSDP and hybrid.world_size == hybrid.data_ranks == n * shard, seed
    assert ParallelDims.of_mode(HSDP, n * shard, ranks_per_node=shard) == \
        ParallelDims(replicate=n, shard=shard, engine="fsdp2", ranks_per_node=shard), seed
    with pytest.raises(ValueError, match=r"HSDP shards within a node .* give ranks_per_node"):
        ParallelDims(replicate=n, shard=2 * shard, engine="fsdp2", ranks_per_node=shard)
    with pytest.raises(ValueError, match="give the ranks of a node with --node-size"):
        ParallelDims.of_mode(HSDP, n * shard)
    with pytest.raises(ValueError, match="one node of .* has no replicas: that is --parallel fsdp"):
        ParallelDims.of_mode(HSDP, n, ranks_per_node=n)
    with pytest.raises(ValueError, match="does not divide the world"):
        ParallelDims.of_mode(HSDP, 2 * n + 1, ranks_per_node=2)
    with pytest.raises(ValueError, match="pipeline stages and data parallelism are not combined"):
        ParallelDims(pipeline=n, replicate=rng.randint(2, 4))
    for bad in (0, -n, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"parallel\.shard must be a whole number >= 1"):
            ParallelDims(shard=bad, engine="fsdp2")
    with pytest.raises(ValueError, match="parallel.engine must be one of"):
        ParallelDims(shard=n, engine="zero3")
    with pytest.raises(ValueError, match="ranks_per_node is for data-parallel ranks"):
        ParallelDims(pipeline=n, ranks_per_node=1)
    node = rng.choice(_divisors(n))  # replicas keep the nodes they were priced over (a what-if plan's)
    assert ParallelDims(replicate=n, ranks_per_node=node).validate(n).ranks_per_node == node
    world = rng.choice([w for w in range(6, 40) if len(_divisors(w)) < w])  # one with a non-divisor below it
    node = rng.choice([d for d in range(2, world) if world % d])
    with pytest.raises(ValueError, match=f"ranks_per_node {node} does not divide"):
        ParallelDims(shard=world, engine="fsdp2", ranks_per_node=node).validate(world)
    fine = rng.choice(_divisors(world))
    ParallelDims(shard=world, engine="fsdp2", ranks_per_node=fine).validate(world)


def test_modes_and_layouts_map_through_the_dims():
    """Each runtime parallel mode over N ranks gives dims whose mode is it again (none only for one rank, ddp for
    several), and each layout word the dims' own; a launch (older plans) reads into the dims of its mode."""
    seed, rng = fresh_rng()
    for mode in PARALLEL_MODES:
        n = 1 if mode == NONE else rng.randint(2, 33)
        dims = ParallelDims.of_mode(mode, n, ranks_per_node=_node(mode, n, rng))
        assert dims.mode == mode and dims.world_size == n, (seed, mode)
        bare = {"parallel": mode, "processes": n}  # hsdp's node size is read off its command
        assert ParallelDims.of_launch(bare if mode != HSDP else launch_of(dims)) == dims, seed
        assert launch_of(dims)["parallel"] == mode and launch_of(dims)["processes"] == n, seed
    assert ParallelDims.of_mode(DDP, 1).mode == NONE  # one replica is one process
    # a sharded state searched on one rank keeps its engine: it shards over the ranks it is launched on
    for layout, mode in ((FSDP, FSDP),):
        one = ParallelDims.of_layout(layout, 1)
        assert one.sharded and one.mode == mode and one.fixes_world, seed
    assert not ParallelDims.of_layout(REPLICATED, rng.randint(1, 9)).fixes_world
    with pytest.raises(ValueError, match="pipeline stages keep a replicated state"):
        ParallelDims.of_layout(FSDP, 4, rng.randint(2, 4))


def test_a_plan_written_before_1_8_loads_into_the_dims_of_its_launch():
    """A 1.7 plan with only `launch` loads with the `parallel` section its launch means (the same dims as the
    search writes now for that layout), and so does its data written back; a 1.8 plan carrying the dims loads
    into the same Plan."""
    from agoq.formats.plan import plan_from_dict
    from agoq.search.plan_builder import dims_for, launch_for

    seed, rng = fresh_rng()
    for layout, gradients in ((REPLICATED, "quangrad8"), (FSDP, "bf16"), (FSDP, "sdp4bit")):
        world = rng.randint(2, 24)
        data = {"schema": "agoq.plan/1.7", "model": {"name": "m", "fingerprint": "0123456789abcdef"},
                "layers": [{"layer": i} for i in range(3)], "gradients": {"mode": gradients},
                "launch": launch_for(1, gradients, world, layout),
                "decision": {"knobs": {"layout": rng.choice(LAYOUTS)}}}  # older decisions are not held to it
        plan = plan_from_dict(data)
        expected = dims_for(1, gradients, world, layout)
        assert plan.dims() == expected and plan.to_dict()["parallel"] == expected.to_dict(), seed
        assert plan.to_dict()["launch"] == data["launch"], seed
        again = plan_from_dict(plan.to_dict())
        assert again.dims() == expected, seed
        newer = {**{k: v for k, v in data.items() if k != "launch"}, "schema": "agoq.plan/1.8",
                 "parallel": expected.to_dict(), "decision": {"knobs": {"layout": layout}}}
        assert plan_from_dict(newer).dims() == expected and plan_from_dict(newer).to_dict()["launch"] == \
            data["launch"], seed
    stages = rng.randint(2, 3)
    piped = plan_from_dict({"schema": "agoq.plan/1.7", "model": {"name": "m", "fingerprint": "0123456789abcdef"},
                            "layers": [{"layer": i, "stage": min(i, stages - 1)} for i in range(3)],
                            "pipeline": {"stages": stages}, "launch": launch_for(stages, "bf16", 1)})
    assert piped.dims() == ParallelDims(pipeline=stages), seed
    assert plan_dims({"launch": {"parallel": "ddp", "processes": 3}}) == ParallelDims(replicate=3)
    assert plan_dims({"gradients": {"mode": "sdp4bit"}}) is None  # a 1.0 plan says nothing of its ranks
    # a plan of agoq's retired own sharded step, of any schema: refused, saying what to run instead
    base = {"model": {"name": "m", "fingerprint": "0123456789abcdef"}, "layers": [{"layer": i} for i in range(3)],
            "gradients": {"mode": "sdp4bit"}}
    world = rng.randint(2, 24)
    for old in ({**base, "schema": "agoq.plan/1.7", "launch": {"processes": world, "parallel": "sharded",
                                                               "command": "torchrun ... --parallel sharded"}},
                {**base, "schema": "agoq.plan/1.8", "parallel": {"shard": world, "engine": "sdp4bit"}}):
        with pytest.raises(ValueError, match=r"own sharded path.*was retired.*--parallel fsdp --gradients sdp4bit "
                                             r"--weight-gather int4 --node-size 1"):
            plan_from_dict(old)


def test_a_plan_whose_decision_or_launch_contradicts_its_dims_is_refused():
    """A 1.8 plan whose decision's layout knob is not its dims' layout (the plan would launch what was not
    decided), whose `launch` disagrees with its dims, or whose pipeline dimension is not its stages: refused,
    naming the field."""
    from agoq.formats.plan import plan_from_dict

    seed, rng = fresh_rng()
    world = rng.randint(2, 16)
    layout = rng.choice(LAYOUTS)
    dims = ParallelDims.of_layout(layout, world, ranks_per_node=_node(layout, world, rng))
    base = {"schema": "agoq.plan/1.8", "model": {"name": "m", "fingerprint": "0123456789abcdef"},
            "layers": [{"layer": i} for i in range(3)], "parallel": dims.to_dict()}
    plan_from_dict({**base, "decision": {"knobs": {"layout": layout}}})
    other = rng.choice([lay for lay in LAYOUTS if lay != layout])
    with pytest.raises(ValueError, match=rf"decision\.knobs\.layout: the decision says layout {other}"):
        plan_from_dict({**base, "decision": {"knobs": {"layout": other}}})
    wrong = launch_of(ParallelDims.of_layout(layout, world + 1, ranks_per_node=1 if layout == HSDP else None))
    with pytest.raises(ValueError, match=r"launch: .* contradicts the plan's parallel dims"):
        plan_from_dict({**base, "launch": wrong})
    with pytest.raises(ValueError, match=r"parallel: .*tensor parallelism is not supported yet"):
        plan_from_dict({**base, "parallel": {"tensor": 2}})
    with pytest.raises(ValueError, match=r"parallel\.pipeline: 2 stage\(s\), pipeline\.stages says 1"):
        plan_from_dict({**base, "parallel": {"pipeline": 2}})


def test_the_dashboard_counts_the_data_ranks_of_every_layout():
    """Tokens per step are micro-batch x sequence x accumulation x data ranks: every rank for ddp, sharded and
    fsdp (replicate x shard), one batch for a pipeline's stages, from a 1.8 plan's dims or an older plan's
    launch alike."""
    from dashboard.planner import tokens_per_step

    seed, rng = fresh_rng()
    for mode in PARALLEL_MODES:
        n = 1 if mode == NONE else rng.randint(2, 17)
        training = {"micro_batch": rng.randint(1, 8), "seq_len": rng.randint(1, 512), "grad_accum": rng.randint(1, 4)}
        dims = ParallelDims.of_mode(mode, n, ranks_per_node=_node(mode, n, rng))
        ranks = 1 if mode == PIPELINE else n
        want = training["micro_batch"] * training["seq_len"] * training["grad_accum"] * ranks
        assert tokens_per_step({"training": training, "parallel": dims.to_dict()}) == want, (seed, mode)
        assert tokens_per_step({"training": training, "launch": launch_of(dims)}) == want, (seed, mode)


def test_the_runtime_layout_is_the_same_dims():
    """agoq train's ParallelLayout of each mode over random worlds has the dims of that mode, reads its data ranks
    off them (every rank but a pipeline's), and refuses ranks per node that do not divide its world."""
    from agoq.layout import ParallelLayout

    seed, rng = fresh_rng()
    for mode in PARALLEL_MODES:
        world = 1 if mode == NONE else rng.randint(2, 40)
        node = _node(mode, world, rng) if world > 1 else None
        layout = ParallelLayout.of(mode, world, node_size=node)
        assert layout.dims == ParallelDims.of_mode(mode, world, ranks_per_node=node), (seed, mode)
        assert layout.dims.mode == mode, (seed, mode)
        assert layout.data_ranks == (1 if mode == PIPELINE else world), (seed, mode)
    world = rng.choice([6, 10, 12, 14, 15, 18, 20, 21])
    node = rng.choice([d for d in range(2, world) if world % d])
    with pytest.raises(ValueError, match=f"ranks_per_node {node} does not divide"):
        ParallelLayout.of(FSDP, world, node_size=node)
    ParallelLayout.of(FSDP, world, node_size=rng.choice([d for d in _divisors(world)]))
