"""Layout hsdp (agoq.search.hsdp): FSDP2 sharded within a node, its shards all-reduced across nodes, offered only
where a what-if's ranks span nodes; priced against a closed form from the network's links, planned as
`agoq train --parallel hsdp --node-size S` accepts, and faster than fsdp over many nodes on a slow link."""

from __future__ import annotations

import json
import math
import random

import pytest

from agoq.cli import main
from agoq.formats.plan import load_plan
from agoq.formats.profile import load_profile
from agoq.parallel_dims import ParallelDims
from agoq.search.costs import ProblemSettings, model_problem
from agoq.search.layouts import hsdp_refusal, layouts, unit_sizes
from agoq.search.network import Kernel
from agoq.search.price import Configuration, price
from agoq.search.state import state_parts, state_per_rank
from agoq.search.timing import prices
from agoq.search.whatif import retarget


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


# ------------------------------------------------------------------------ the closed form, by hand, float64


def _ring(alpha: float, beta: float, p: int, nbytes: float) -> float:
    """A ring reduce-scatter or all-gather of p ranks: (p - 1) alpha + (p - 1) / p x bytes / beta."""
    return 0.0 if p <= 1 else (p - 1) * alpha + (p - 1) / p * nbytes / beta


def _all_reduce(alpha: float, beta: float, p: int, nbytes: float) -> float:
    """One level, the faster of NCCL's ring (2 (p - 1) steps) and tree (2 ceil(log2 p) steps, twice the bytes)."""
    if p <= 1:
        return 0.0
    return min(2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta,
               2 * math.ceil(math.log2(p)) * alpha + 2 * nbytes / beta)


def _kernel(network, op: str, path: str, message_bytes: float) -> float:
    return network.kernels.get((op, path), Kernel()).seconds(message_bytes)


def _hsdp_by_hand(network, mode: str, s: int, r: int, root: int, layer: int, num_layers: int, fb: float,
                  accum: int) -> tuple[float, float]:
    """(HSDP's communication per step, a bound on the table's interpolation error of it), from the links."""
    ai, bi = network.intra.latency, network.intra.bandwidth
    ae, be = network.inter.latency, network.inter.bandwidth

    def unit(n: int) -> tuple[float, float, float]:
        if not n:
            return 0.0, 0.0, 0.0
        ag = _ring(ai, bi, s, 2.0 * n)  # bf16 weights inside the node
        if mode == "bf16":
            rs = _ring(ai, bi, s, 2.0 * n)
            ar = _all_reduce(ae, be, r, 2.0 * n / s)  # the node's shard, bf16, one rank per node
        elif mode == "quangrad8":  # FSDP2's float32 reduce-scatter; QuanGrad's all-to-all + all-gather across
            rs = _ring(ai, bi, s, 4.0 * n)
            ar = 2 * _ring(ae, be, r, n / s * (1 + 4 / 256)) + _kernel(network, "all_reduce", "quangrad8",
                                                                        4.0 * n / s)
        else:  # sdp4bit: TLq-HS's int8 all-to-all in the node, TLq's 4-bit all-to-all + all-gather across nodes
            rs = _ring(ai, bi, s, n * (1 + 4 / 128)) + _kernel(network, "reduce_scatter", "sdp4bit", 4.0 * n)
            ar = 2 * _ring(ae, be, r, n / s * (0.5 + 4 / 128)) + _kernel(network, "all_reduce", "tlq4", 4.0 * n / s)
        return ag, rs, ar

    ag_l, rs_l, ar_l = unit(layer)
    ag_r, rs_r, ar_r = unit(root)
    t = fb / num_layers

    def exposed(a: int) -> float:
        return num_layers * (max(0.0, ag_l - t / 3) + max(0.0, ag_l + rs_l + a * ar_l - 2 * t / 3)) \
            + 2 * ag_r + rs_r + a * ar_r

    per_step = (accum - 1) * exposed(0) + exposed(1) if mode == "bf16" else accum * exposed(1)
    scale = accum * (num_layers * (2 * ag_l + rs_l + ar_l) + 2 * ag_r + rs_r + ar_r)
    return per_step, scale


def test_hsdp_prices_the_closed_form_and_keeps_a_nodes_share_of_the_state(two_rank_profile):
    """On a random world of several nodes (sizes not powers of two) and random links: the priced step's
    communication is the closed form of agoq.search.hsdp's docstring computed here from the links (within the
    modelled table's interpolation), its compute accum x fb + optimizer / S, and the state per rank 1/S of it."""
    seed, rng = fresh_rng()
    profile = load_profile(two_rank_profile)
    s, r = rng.choice([(4, 3), (6, 3), (3, 5), (5, 4), (6, 7)])
    spec = (f"intra={rng.uniform(50, 500):.6g}@{rng.uniform(1, 10):.6g},"
            f"inter={rng.uniform(0.5, 5):.6g}@{rng.uniform(5, 40):.6g}")
    target, whatif = retarget(profile, s * r, s, spec)
    assert target.node_size == s and target.world_size == s * r, seed
    units = unit_sizes(profile.model_config(), int(profile.header["model"]["parameters"]), profile.num_layers)
    for mode in ("bf16", "quangrad8", "sdp4bit"):
        accum = rng.randint(1, 3)
        knobs = ProblemSettings(gradient_mode=mode, layout="hsdp", optimizer="adamw8bit", master="fp32",
                                micro_batch=2, grad_accum=accum)
        got = price(target, Configuration(knobs))
        fb, once = prices(profile).split_parts("eager", 2, "bf16", "adamw8bit", "fp32")
        want, scale = _hsdp_by_hand(whatif.network, mode, s, r, units.root, units.layer, profile.num_layers, fb,
                                    accum)
        assert abs(got.communication_seconds - want) <= 0.01 * scale + 1e-12, (seed, mode, got, want)
        problem = model_problem(target, knobs)
        assert problem.base_seconds - problem.communication_seconds == pytest.approx(accum * fb + once / s,
                                                                                     rel=1e-9), seed
        # memory per rank: the whole state / S (FSDP2's float32 shards: masters and bf16-sized gradients), and the
        # units in flight as fsdp's: bf16 root + two layers, and one unit's gradients before the reduce-scatter
        whole = state_parts(profile, "bf16", "adamw8bit", "fp32")
        mine = state_per_rank(target, mode, "adamw8bit", "fp32", "hsdp")
        for part, name in (("weights", "weights"), ("gradients", "gradients"), ("masters", "masters"),
                           ("optimizer_state", "moments")):
            assert mine[part] == pytest.approx(whole[name] / s, rel=1e-12), (seed, part)
            assert float(problem.static_parts[part][0]) == pytest.approx(whole[name] / s, rel=1e-12), (seed, part)
        g = 2 if mode == "bf16" else 4
        flight = 2 * (units.root + 2 * units.layer) + g * max(units.root, units.layer)
        assert float(problem.static_parts["fsdp_unsharded"][0]) == pytest.approx(flight), seed
        assert "backward_gradients" not in problem.static_parts, seed  # no QuanGrad buffer under FSDP2


def test_hsdp_groups_leave_fsdp_and_ddp_prices_as_they_were(two_rank_profile):
    """The modelled table's HSDP groups (rows of "node" and "replicas") change no fsdp or replicated price: priced
    again on the table's "world" rows alone, without the group column, every figure is the same, bit for bit."""
    import dataclasses

    seed, rng = fresh_rng()
    profile = load_profile(two_rank_profile)
    s = rng.randint(2, 6)
    target, _ = retarget(profile, s * rng.randint(2, 6), s, "nvlink-h100+roce-100g")
    table = target.collectives
    assert set(table["group"]) == {"world", "node", "replicas"}, seed
    plain = dataclasses.replace(target, collectives=table[table["group"] == "world"].drop(columns="group")
                                .reset_index(drop=True), cache={})
    for layout, mode in (("fsdp", "bf16"), ("fsdp", "sdp4bit"), ("replicated", "bf16"), ("replicated", "quangrad8")):
        knobs = ProblemSettings(gradient_mode=mode, layout=layout, optimizer="adamw8bit", master="fp32",
                                micro_batch=2, grad_accum=rng.randint(1, 2))
        a, b = price(target, Configuration(knobs)), price(plain, Configuration(knobs))
        assert (a.step_seconds, a.communication_seconds, a.peak_bytes_per_stage) == \
            (b.step_seconds, b.communication_seconds, b.peak_bytes_per_stage), (seed, layout, mode)


def test_hsdp_is_offered_only_where_the_ranks_span_nodes(two_rank_profile):
    """hsdp is offered for a what-if of several nodes of several ranks; not on the measured profile (one machine),
    not with one node (S = N: fsdp) and not with nodes of one rank (S = 1: replicated), each saying why; asked for
    anyway, the cost model refuses it with the reason."""
    seed, rng = fresh_rng()
    profile = load_profile(two_rank_profile)
    assert profile.node_size == profile.world_size == 2
    s = rng.randint(2, 6)
    n = s * rng.randint(2, 5)
    spanning, _ = retarget(profile, n, s, "nvlink-h100+ib-ndr400")
    one_node, _ = retarget(profile, n, n, "nvlink-h100+ib-ndr400")
    single, _ = retarget(profile, n, 1, "nvlink-h100+ib-ndr400")
    for mode in ("bf16", "quangrad8", "sdp4bit"):
        assert "hsdp" in layouts(n, spanning.collectives, mode, node_size=spanning.node_size), (seed, mode)
        assert "hsdp" not in layouts(n, one_node.collectives, mode, node_size=one_node.node_size), (seed, mode)
        assert "hsdp" not in layouts(n, single.collectives, mode, node_size=single.node_size), (seed, mode)
        assert "hsdp" not in layouts(2, profile.collectives, mode, node_size=profile.node_size), (seed, mode)
        assert "hsdp" not in layouts(n, spanning.collectives, mode), (seed, mode)  # no node size: one node
    assert "do not span nodes" in hsdp_refusal(n, n, one_node.collectives, "bf16")
    assert "nodes of one rank" in hsdp_refusal(n, 1, single.collectives, "bf16")
    assert "pipeline stage" in hsdp_refusal(n, s, spanning.collectives, "bf16", stages=2)
    knobs = ProblemSettings(gradient_mode="bf16", layout="hsdp", micro_batch=2)
    for target in (profile, one_node):
        with pytest.raises(ValueError, match="layout hsdp is not offered here: .*do not span nodes"):
            model_problem(target, knobs)


def _search(profile_dir, out, *extra):
    return main(["search", "--profile", str(profile_dir), "--budget", "1GiB", "--out", str(out), "--quiet",
                 "--front-budgets", "0", *extra])


def test_search_layout_hsdp_writes_a_plan_agoq_train_accepts(two_rank_profile, tmp_path, capsys):
    """`agoq search --world-size 16 --node-size 4 --layout hsdp`: a plan of replicate 4 x shard 4 (FSDP2), launched
    as --parallel hsdp --node-size 4 over 4 nodes, which agoq train's plan checks accept in 16 processes of hsdp
    (and refuse as fsdp), compared with HSDP's own bf16; without a what-if --layout hsdp is a clear usage error."""
    from agoq.layout import ParallelLayout, check_plan_world, plan_layout

    out = tmp_path / "plan.json"
    assert _search(two_rank_profile, out, "--world-size", "16", "--node-size", "4", "--network",
                   "nvlink-h100+roce-100g", "--layout", "hsdp") == 0
    plan = load_plan(out)
    dims = plan.dims()
    assert dims == ParallelDims(replicate=4, shard=4, engine="fsdp2", ranks_per_node=4)
    assert (dims.mode, dims.layout, dims.data_ranks) == ("hsdp", "hsdp", 16)
    data = json.loads(out.read_text())
    assert data["launch"]["parallel"] == "hsdp" and data["launch"]["processes"] == 16
    assert "--parallel hsdp --node-size 4" in data["launch"]["command"]
    assert ParallelDims.of_launch(data["launch"]) == ParallelDims(replicate=4, shard=4, engine="fsdp2",
                                                                 ranks_per_node=4)
    assert data["whatif"]["launch"].startswith("torchrun --nnodes 4 --nproc-per-node 4")
    assert data["whatif"]["launch"].endswith("--parallel hsdp --node-size 4" + data["launch"]["command"].split(
        "--node-size 4", 1)[1])
    assert plan_layout(plan).parallel == "hsdp" and plan_layout(plan).processes == 16
    check_plan_world(plan, 16, "hsdp", "MODEL", "plan.json")  # what agoq train checks: accepted
    with pytest.raises(ValueError, match="--parallel hsdp --node-size 4"):
        check_plan_world(plan, 16, "fsdp", "MODEL", "plan.json")
    assert ParallelLayout(mode="hsdp", world_size=16, node_size=dims.ranks_per_node).mode == "hsdp"
    names = [a["name"] for a in data["alternatives"] if a["layout"] == "hsdp"]
    assert names and all(name.startswith("HSDP ") and " bf16" in name for name in names), names
    capsys.readouterr()
    refused = tmp_path / "refused.json"
    assert _search(two_rank_profile, refused, "--layout", "hsdp") == 2
    err = capsys.readouterr().err
    assert "hsdp is not offered" in err and "do not span nodes" in err and "--world-size" in err, err
    assert "Traceback" not in err and not refused.exists()


def test_hsdp_beats_fsdp_over_many_nodes_on_a_slow_link(two_rank_profile):
    """Over many nodes of 8 on 25 GbE, FSDP2 over every rank crosses the slow link for every unit's gathers and
    reduce-scatter: HSDP's communication and step, at equal knobs, are predicted less than fsdp's."""
    seed, rng = fresh_rng()
    profile = load_profile(two_rank_profile)
    nodes = rng.randint(48, 80)
    target, _ = retarget(profile, 8 * nodes, 8, "nvlink-h100+ethernet-25g")
    accum = rng.randint(1, 2)
    figures = {}
    for layout in ("fsdp", "hsdp"):
        knobs = ProblemSettings(gradient_mode="bf16", layout=layout, optimizer="adamw", master="fp32",
                                micro_batch=2, grad_accum=accum)
        figures[layout] = price(target, Configuration(knobs))
    assert figures["hsdp"].communication_seconds < figures["fsdp"].communication_seconds, (seed, figures)
    assert figures["hsdp"].step_seconds < figures["fsdp"].step_seconds, (seed, figures)
