"""TLq-HS's int4 level's kernels in the network model (agoq.search.network): across nodes of more than one rank its
reduce-scatter costs wire + K8(n) + K4(n / G), n = message_bytes / 4 values, K8 the int8 level's timed kernel and K4
the int4 level's (reduce_scatter sdp4bit-int4-level); one node, one rank per node, or kernels without K4 add none.
Each expectation is worked out here by hand from the links and kernels drawn for the test."""

import random

import pytest

from agoq.formats.collective_kernels import INT4_LEVEL
from agoq.search.network import Kernel, Link, Network
from agoq.search.whatif import MODEL_SIZES, modelled_table

TLQ_HS = ("reduce_scatter", "sdp4bit")


def _draw(rng):
    """A network of fresh links and kernels (int8 level K8, int4 level K4, qWD's gather), and its numbers."""
    intra = Link(rng.uniform(5e10, 5e11), rng.uniform(1e-6, 2e-5))
    inter = Link(rng.uniform(5e9, 5e10), rng.uniform(5e-6, 5e-5))
    k8 = (rng.uniform(1e-5, 1e-4), rng.uniform(1e-11, 1e-9))
    k4 = (rng.uniform(1e-5, 1e-4), rng.uniform(1e-11, 1e-9))
    kernels = {TLQ_HS: Kernel(*k8), INT4_LEVEL: Kernel(*k4), ("all_gather", "sdp4bit"): Kernel(2e-5, 3e-10)}
    return Network(intra, inter, "test", "drawn for the test", kernels), k8, k4


def _wire(net: Network, world: int, node: int, message_bytes: float) -> float:
    """TLq-HS's wire by hand: int8 + a float32 scale per 128 values all-to-all among the node's G ranks over the whole
    tensor, then int4 + a scale per 128 all-to-all among the M nodes over the node's 1/G (a level of one rank: 0)."""
    values, nodes = message_bytes / 4, world // node
    inside = 0.0 if node == 1 else ((node - 1) * net.intra.latency
                                    + (node - 1) / node * values * (1 + 4 / 128) / net.intra.bandwidth)
    across = 0.0 if nodes == 1 else ((nodes - 1) * net.inter.latency
                                     + (nodes - 1) / nodes * values / node * (0.5 + 4 / 128) / net.inter.bandwidth)
    return inside + across


def test_across_nodes_tlq_hs_costs_wire_plus_k8_of_n_plus_k4_of_n_over_g(seed):
    rng = random.Random(seed)
    for _ in range(5):
        net, (f8, p8), (f4, p4) = _draw(rng)
        node, nodes = rng.randrange(2, 9), rng.randrange(2, 7)
        world = node * nodes
        message_bytes = 4 * rng.randrange(10**4, 10**9)
        n = message_bytes / 4
        want = _wire(net, world, node, message_bytes) + (f8 + p8 * n) + (f4 + p4 * n / node)
        assert net.seconds("reduce_scatter", "sdp4bit", message_bytes, world, node) == pytest.approx(want, rel=1e-12)
        parts = dict(net.kernel_parts("reduce_scatter", "sdp4bit", message_bytes, world, node))
        assert parts == pytest.approx({TLQ_HS: f8 + p8 * n, INT4_LEVEL: f4 + p4 * n / node}, rel=1e-12)
        # the int4 level is TLq-HS's reduce-scatter's only: qWD's gather keeps its one kernel
        gather = net.seconds("all_gather", "sdp4bit", message_bytes, world, node)
        alone = Network(net.intra, net.inter, "t", "t", {("all_gather", "sdp4bit"): net.kernels[("all_gather",
                                                                                                  "sdp4bit")]})
        assert gather == alone.seconds("all_gather", "sdp4bit", message_bytes, world, node)


def test_one_node_one_rank_per_node_or_no_k4_add_no_int4_level_kernel(seed):
    rng = random.Random(seed)
    net, (f8, p8), _ = _draw(rng)
    node = rng.randrange(2, 9)
    message_bytes = 4 * rng.randrange(10**4, 10**9)
    n = message_bytes / 4
    nodes = rng.randrange(2, 7)
    without = net.with_kernels({TLQ_HS: net.kernels[TLQ_HS]})  # a version 1 profile's kernels: no K4
    for world, size, network in ((node, node, net),  # one node: G = N, no int4 level
                                 (nodes, 1, net),  # one rank per node: the int8 level's K8 prices the int4 level
                                 (node * nodes, node, without)):  # no K4 timed: nothing added
        want = _wire(network, world, size, message_bytes) + f8 + p8 * n
        got = network.seconds("reduce_scatter", "sdp4bit", message_bytes, world, size)
        assert got == pytest.approx(want, rel=1e-12), (world, size)
        assert [k for k, _ in network.kernel_parts("reduce_scatter", "sdp4bit", message_bytes, world, size)] == [TLQ_HS]
    assert net.seconds("reduce_scatter", "sdp4bit", message_bytes, 1, 1) == 0.0 and not net.kernel_parts(
        "reduce_scatter", "sdp4bit", message_bytes, 1, 1)


def test_the_modelled_tables_kernel_column_holds_both_levels_across_nodes_and_k8_in_the_node(seed):
    """The what-if's table (agoq.search.whatif.modelled_table): with both kernels timed in one process, TLq-HS's
    kernel seconds over the world (1 < G < N) are K8(n) + K4(n / G); over HSDP's node group (G ranks, one node)
    K8(n)."""
    rng = random.Random(seed)
    net, (f8, p8), (f4, p4) = _draw(rng)
    node, nodes = rng.randrange(2, 9), rng.randrange(2, 7)
    table = modelled_table(net, node * nodes, node, (TLQ_HS, INT4_LEVEL))
    mine = table[(table["op"] == "reduce_scatter") & (table["path"] == "sdp4bit")]
    for group, k4 in (("world", True), ("node", False)):
        rows = mine[mine["group"] == group]
        assert len(rows) == len(MODEL_SIZES)
        for size, got in zip(rows["message_bytes"], rows["kernel_seconds"]):
            n = size / 4
            assert got == pytest.approx(f8 + p8 * n + ((f4 + p4 * n / node) if k4 else 0.0), rel=1e-12)
    only_k8 = modelled_table(net, node * nodes, node, (TLQ_HS,))  # K4 not among the compute kernels: not counted
    world = only_k8[(only_k8["op"] == "reduce_scatter") & (only_k8["path"] == "sdp4bit")
                    & (only_k8["group"] == "world")]
    assert list(world["kernel_seconds"]) == pytest.approx([f8 + p8 * s / 4 for s in world["message_bytes"]], rel=1e-12)
