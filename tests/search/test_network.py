"""The latency-bandwidth model of collectives (agoq.search.network): its fit recovers a known link from noisy
measurements, and its two-level ring terms match a step-by-step simulation of the rings moving real data."""

import math
import random

import numpy as np
import pandas as pd
import pytest

from agoq.search.network import (
    WIRE_BYTES,
    Cluster,
    Kernel,
    Link,
    Network,
    all_gather,
    all_reduce,
    reduce_scatter,
    ring_all_reduce,
)
from agoq.search.network_fit import fit_collectives
from agoq.search.network_spec import PRESETS, parse_network


def _table(rng, net: Network, world: int, noise: float) -> pd.DataFrame:
    rows = []
    for op, path in (("all_reduce", "nccl-fp32"), ("reduce_scatter", "nccl-bf16"), ("all_gather", "nccl-bf16"),
                     ("all_reduce", "nccl-bf16"), ("reduce_scatter", "sdp4bit"), ("all_reduce", "quangrad8")):
        for size in np.exp(rng.uniform(np.log(3e5), np.log(2e9), 7)):
            size = float(int(size) // 4 * 4)
            t = net.seconds(op, path, size, world, world) * (1 + noise * rng.standard_normal())
            rows.append({"op": op, "path": path, "world_size": world, "message_bytes": size, "seconds": t})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("draw", range(3))
def test_fit_recovers_a_known_link_and_kernels(draw):
    seed = random.getrandbits(32)  # fresh per run: tests/conftest.py seeds and reports it
    rng = np.random.default_rng(seed)
    link = Link(rng.uniform(1.5e9, 90e9), rng.uniform(4e-6, 150e-6))
    kernels = {("reduce_scatter", "sdp4bit"): Kernel(rng.uniform(1e-4, 8e-4), rng.uniform(5e-12, 5e-11)),
               ("all_reduce", "quangrad8"): Kernel(rng.uniform(1e-4, 8e-4), rng.uniform(5e-12, 5e-11))}
    truth = Network(link, link, "truth", "test", kernels)
    world = int(rng.integers(2, 9))
    table = _table(rng, truth, world, noise=0.01)
    fit = fit_collectives(table)
    assert fit.world == world
    assert fit.link.bandwidth == pytest.approx(link.bandwidth, rel=0.03), seed
    assert fit.link.latency == pytest.approx(link.latency, rel=0.15), seed
    for (op, path), k in kernels.items():  # the kernels' seconds at the largest message, within the noise of its time
        big = float(table[(table["op"] == op) & (table["path"] == path)]["message_bytes"].max())
        total = truth.seconds(op, path, big, world, world)
        assert abs(fit.kernels[(op, path)].seconds(big) - k.seconds(big)) < 0.06 * total, seed
    assert np.max(np.abs(fit.residuals())) < 0.06, seed  # 1 % noise: the residuals are the noise


def test_fit_refuses_a_profile_without_collectives():
    with pytest.raises(ValueError, match="--network"):
        fit_collectives(None)


# ----------------------------------------------------------------------------- a step-by-step simulation


class Sim:
    """Ranks holding real vectors; every exchange is a round of (sender, receiver, values) messages, timed as the
    slowest message of the round (latency + bytes / bandwidth of the link between the two ranks' nodes)."""

    def __init__(self, world, node_size, intra, inter, elem):
        self.world, self.g, self.intra, self.inter, self.elem = world, node_size, intra, inter, elem
        self.seconds = 0.0

    def round(self, messages):
        worst = 0.0
        for src, dst, nvalues in messages:
            link = self.intra if src // self.g == dst // self.g else self.inter
            worst = max(worst, link.seconds(1, nvalues * self.elem))
        self.seconds += worst

    def ring_reduce_scatter(self, groups, data, chunks):
        """Every group (ranks in ring order) reduce-scatters data[r] (arrays cut into len(group) chunks each of the
        same size): returns {rank: the chunk it owns, summed over the group}."""
        out = {}
        p = len(groups[0])
        if p == 1:
            return {g[0]: data[g[0]] for g in groups}
        bufs = {r: list(np.split(data[r].copy(), p)) for g in groups for r in g}
        for step in range(p - 1):
            msgs, sends = [], []
            for g in groups:
                for i, r in enumerate(g):
                    c = (i - step - 1) % p
                    nxt = g[(i + 1) % p]
                    sends.append((nxt, c, bufs[r][c].copy()))
                    msgs.append((r, nxt, bufs[r][c].size))
            self.round(msgs)
            for dst, c, vals in sends:
                bufs[dst][c] += vals
        for g in groups:
            for i, r in enumerate(g):
                out[r] = bufs[r][i]  # after p-1 steps rank i holds chunk i complete
        return out

    def ring_all_gather(self, groups, pieces):
        """Every group all-gathers pieces[r]: returns {rank: the pieces laid end to end in ring order}."""
        p = len(groups[0])
        have = {r: {i: pieces[r]} for g in groups for i, r in enumerate(g)}
        for step in range(p - 1):
            msgs, sends = [], []
            for g in groups:
                for i, r in enumerate(g):
                    c = (i - step) % p
                    nxt = g[(i + 1) % p]
                    sends.append((nxt, c, have[r][c]))
                    msgs.append((r, nxt, have[r][c].size))
            if msgs:
                self.round(msgs)
            for dst, c, vals in sends:
                have[dst][c] = vals
        return {r: np.concatenate([have[r][i] for i in range(p)]) for g in groups for r in g}


def _groups(world, g):
    nodes = world // g
    intra = [[n * g + i for i in range(g)] for n in range(nodes)]
    inter = [[n * g + i for n in range(nodes)] for i in range(g)]
    return intra, inter


def _simulated(world, g, intra, inter, values, elem, rng):
    """Two-level reduce-scatter, all-gather and all-reduce on real data: (seconds of each, checked results)."""
    data = {r: rng.standard_normal(values) for r in range(world)}
    total = sum(data.values())
    ig, eg = _groups(world, g)
    sim = Sim(world, g, intra, inter, elem)
    node_part = sim.ring_reduce_scatter(ig, data, g)           # rank (n, i) holds node n's sum of chunk i
    shard = sim.ring_reduce_scatter(eg, node_part, world // g)  # ... then chunk i's sub-chunk n over all nodes
    rs = sim.seconds
    for r in range(world):
        n, i = divmod(r, g)
        chunk = np.split(total, g)[i]
        np.testing.assert_allclose(shard[r], np.split(chunk, world // g)[n], rtol=1e-9, atol=1e-9)
    sim.seconds = 0.0
    back = sim.ring_all_gather(eg, shard)
    full = sim.ring_all_gather(ig, back)
    ag = sim.seconds
    for r in range(world):
        np.testing.assert_allclose(full[r], total, rtol=1e-9, atol=1e-9)
    return rs, ag


@pytest.mark.parametrize("world,g", [(2, 2), (3, 3), (4, 2), (6, 3), (6, 2), (4, 1), (8, 4)])
def test_two_level_terms_match_a_simulated_ring(world, g):
    rng = np.random.default_rng(random.getrandbits(32))  # fresh per run (tests/conftest.py reports the seed)
    intra = Link(rng.uniform(50e9, 400e9), rng.uniform(1e-6, 5e-6))
    inter = Link(rng.uniform(2e9, 40e9), rng.uniform(5e-6, 40e-6))
    values = world * int(rng.integers(50, 400))
    elem = 2.0
    rs, ag = _simulated(world, g, intra, inter, values, elem, rng)
    c = Cluster(world, g, intra, inter)
    nbytes = values * elem
    assert reduce_scatter(c, nbytes) == pytest.approx(rs, rel=1e-12)
    assert all_gather(c, nbytes) == pytest.approx(ag, rel=1e-12)
    if c.nodes > 1 and g > 1:  # RS(intra) + AR(inter) + AG(intra): the ring all-reduce across nodes is RS + AG
        ring = rs + ag
        assert all_reduce(c, nbytes) <= ring * (1 + 1e-12)
    else:
        assert ring_all_reduce(intra if c.nodes == 1 else inter, world, nbytes) == pytest.approx(rs + ag, rel=1e-12)


def test_wire_bytes_are_the_runtimes_formats():
    from agoq.runtime.comm import fsdp_weight_gather, quantized_allreduce, sdp4bit

    assert WIRE_BYTES["sdp4bit-intra"] == sdp4bit.INTRA_BITS / 8 + 4 / sdp4bit.GRAD_GROUP
    assert WIRE_BYTES["sdp4bit-inter"] == sdp4bit.INTER_BITS / 8 + 4 / sdp4bit.GRAD_GROUP
    assert WIRE_BYTES["sdp4bit-weights"] == sdp4bit.WEIGHT_BITS / 8 + 4 / sdp4bit.WEIGHT_BLOCK
    assert WIRE_BYTES["quangrad8"] == 1 + 4 / quantized_allreduce.DEFAULT_BLOCK
    assert WIRE_BYTES["int8-weights"] == 1 + 4 / fsdp_weight_gather.DEFAULT_BLOCK
    assert WIRE_BYTES["int4-weights"] == 0.5 + 4 / fsdp_weight_gather.DEFAULT_BLOCK


def test_quantized_paths_send_fewer_bytes_across_nodes():
    net = parse_network("nvlink-h100+roce-100g")
    size = 4.0 * 7_000_003
    bf16 = net.seconds("reduce_scatter", "nccl-bf16", size, 64, 8)
    tlq = net.seconds("reduce_scatter", "sdp4bit", size, 64, 8)
    assert tlq < bf16
    assert net.seconds("all_gather", "sdp4bit", size, 64, 8) < net.seconds("all_gather", "nccl-bf16", size, 64, 8)
    assert net.seconds("all_reduce", "nccl-bf16", size, 1, 1) == 0.0


def test_network_spec():
    net = parse_network("intra=123.5@2.5,inter=12GBps@7us")
    assert net.intra.bandwidth == pytest.approx(123.5e9) and net.intra.latency == pytest.approx(2.5e-6)
    assert net.inter.bandwidth == pytest.approx(12e9) and net.inter.latency == pytest.approx(7e-6)
    one = parse_network("ib-ndr400")
    assert one.intra == one.inter == PRESETS["ib-ndr400"].link and "ConnectX-7" in one.source
    both = parse_network("nvlink-a100+ib-hdr200")
    assert both.intra == PRESETS["nvlink-a100"].link and both.inter == PRESETS["ib-hdr200"].link
    for bad, words in (("infiniband", "unknown network"), ("intra=10@1", "both"), ("intra=0@1,inter=1@1", "bandwidth"),
                       ("intra=x@1,inter=1@1", "GBps@us"), ("a+b+c", "at most two"), ("", "needs a value")):
        with pytest.raises(ValueError, match=words):
            parse_network(bad)
    assert all(math.isfinite(p.bandwidth) and p.source for p in PRESETS.values())
