"""The collective-kernels stage (agoq.profiler.collective_kernels): every quantized path timed on the CPU at a few
sizes, and each path's local sequence giving what its collective would when every rank holds the same tensor (so it
runs the collective's kernels on the collective's data, with the exchange left out)."""

import random

import torch

from agoq.formats.collective_kernels import INT4_LEVEL, PATHS
from agoq.profiler.collective_kernels import CASES, GATHER_COLUMNS, INT4_NODES, message_sizes, time_collective_kernels


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_every_path_is_timed_at_every_size_and_grows_with_it(seed):
    rng = random.Random(seed)
    small = rng.randrange(3000, 6000)
    big = small * rng.randrange(40, 60)
    sizes = message_sizes(big, small)  # a root unit larger than a layer, as a small model's embedding is
    assert len(sizes) == 3 and sizes == sorted(sizes) and all(s % (4 * GATHER_COLUMNS) == 0 for s in sizes)
    assert 4 * small <= sizes[0] < 4 * (small + 128) and 4 * big <= sizes[-1] < 4 * (big + 128)
    rows = time_collective_kernels(sizes, "cpu", repeats=3)
    assert {(r["op"], r["path"]) for r in rows} == set(PATHS) and len(rows) == len(PATHS) * len(sizes)
    assert all(r["seconds"] > 0 for r in rows)
    for key in PATHS:
        mine = sorted((r["message_bytes"], r["seconds"]) for r in rows if (r["op"], r["path"]) == key)
        assert [b for b, _ in mine] == sizes
        assert mine[-1][1] > mine[0][1], (key, mine)  # over 30x the values: more time, whatever the noise


def test_each_local_sequence_gives_its_collectives_result(seed):
    """With every shard of the tensor equal, what this rank sends to its peers is what they would send to it: the
    local sequence must then give the collective's own result (2 ranks, each holding the same tensor)."""
    gen = torch.Generator().manual_seed(seed)
    half = 256 * random.Random(seed).randrange(10, 23)  # whole blocks of every codec: shards of equal layout
    x = torch.randn(half, generator=gen)
    flat = torch.cat([x, x])
    got = {key: CASES[key](flat, 2, 2)() for key in PATHS}
    assert _relative(got[("all_reduce", "quangrad8")], 2 * flat) < 0.02  # int8, rounded twice
    assert got[("reduce_scatter", "sdp4bit")].numel() == half  # this rank's shard of the sum
    assert _relative(got[("reduce_scatter", "sdp4bit")], 2 * x) < 0.05  # int8, stochastic
    assert _relative(got[("all_reduce", "tlq4")], 2 * flat) < 0.5  # int4 twice, stochastic
    assert _relative(got[("all_gather", "sdp4bit")], 1.001 * flat) < 1e-3  # every shard's new weights
    for key, tolerance in ((("all_gather", "int8-weights"), 0.01), (("all_gather", "int4-weights"), 0.2)):
        assert got[key].dtype == torch.bfloat16 and _relative(got[key], flat) < tolerance, key


def test_the_int4_level_sums_the_nodes_rows_in_int4_codes(seed):
    """TLq-HS's int4 level on its own (reduce_scatter sdp4bit-int4-level): the n values are the node's sums, one row
    per node (M = W / G; INT4_NODES where the ranks are one node); what this rank sends each node stands in for what
    that node sends it, so the level gives the sum of the M rows, each rounded stochastically to int4 codes of its
    128-blocks: every value within the sum of the rows' steps (absmax / 7 per block) of the exact sum, and a lone
    non-zero row comes back on its own int4 grid exactly."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for world, node_size in ((2, 2), (2 * rng.randrange(3, 6), 2)):
        nodes = world // node_size if world > node_size else INT4_NODES
        width = 128 * rng.randrange(5, 17)  # this rank's shard, whole 128-blocks
        rows = torch.randn(nodes, width, generator=gen) * torch.rand(nodes, 1, generator=gen).add(0.1)
        got = CASES[INT4_LEVEL](rows.reshape(-1), world, node_size)()
        exact = rows.sum(dim=0)
        assert got.shape == exact.shape and torch.isfinite(got).all()
        steps = (rows.view(nodes, -1, 128).abs().amax(dim=2, keepdim=True) / 7).expand(-1, -1, 128)
        bound = steps.sum(dim=0).reshape(-1)
        assert ((got - exact).abs() <= bound * (1 + 1e-5) + 1e-7).all()
        assert 0.02 < _relative(got, exact) < 0.3  # int4 rounding, well above int8's (about 0.005)
        alone = torch.zeros_like(rows)
        alone[rng.randrange(nodes)] = rows[0]
        grid = CASES[INT4_LEVEL](alone.reshape(-1), world, node_size)().view(-1, 128) / steps[0]
        assert (grid - grid.round()).abs().max() < 1e-4 and grid.abs().max() <= 7 + 1e-4
