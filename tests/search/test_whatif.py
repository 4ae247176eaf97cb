"""A profile re-targeted to N ranks (agoq.search.whatif) and `agoq search --world-size N`: communication from the
network model, compute unchanged, the sharded state 1/N, a plan that says it is a what-if, clear refusals."""

import json
import math
import random

import pytest

from agoq.cli import main
from agoq.formats.plan import load_plan
from agoq.formats.profile import load_profile
from agoq.search.collective_times import collective_seconds
from agoq.search.costs import ProblemSettings, build_problem
from agoq.search.network import Link
from agoq.search.network_spec import parse_network
from agoq.search.state import state_parts, state_per_rank
from agoq.search.whatif import retarget
from tests.search.synthetic_profile import write_profile


def fresh_rng():
    seed = random.getrandbits(32)  # seeded per test: tests/conftest.py
    return seed, random.Random(seed)


def _ring_all_reduce(link: Link, p: int, b: float) -> float:
    """By hand: the faster of the ring (2(p-1) steps, 2(p-1)/p of the bytes) and the tree (2 log2 p, 2x)."""
    if p == 1:
        return 0.0
    ring = 2 * (p - 1) * link.latency + 2 * (p - 1) / p * b / link.bandwidth
    tree = 2 * math.ceil(math.log2(p)) * link.latency + 2 * b / link.bandwidth
    return min(ring, tree)


def _two_level_all_reduce(intra: Link, inter: Link, n: int, g: int, b: float) -> float:
    m = n // g
    if m == 1:
        return _ring_all_reduce(intra, n, b)
    if g == 1:
        return _ring_all_reduce(inter, n, b)
    half = (g - 1) * intra.latency + (g - 1) / g * b / intra.bandwidth
    return half + _ring_all_reduce(inter, m, b / g) + half


def test_retarget_prices_communication_from_the_network_and_shards_the_state(two_rank_profile):
    seed, rng = fresh_rng()
    profile = load_profile(two_rank_profile)
    g = rng.choice([1, 2, 4, 8])
    n = g * rng.randint(2, 16)
    intra_gbps, inter_gbps = rng.uniform(50, 500), rng.uniform(1, 50)
    intra_us, inter_us = rng.uniform(1, 10), rng.uniform(3, 30)
    spec = f"intra={intra_gbps}@{intra_us},inter={inter_gbps}@{inter_us}"
    target, whatif = retarget(profile, n, g, spec)
    assert profile.world_size == 2 and target.world_size == n, seed
    assert (whatif.world, whatif.node_size, whatif.measured_world) == (n, g, 2)
    intra, inter = Link(intra_gbps * 1e9, intra_us * 1e-6), Link(inter_gbps * 1e9, inter_us * 1e-6)
    size = 4.0 * rng.randint(10**5, 10**9)  # between the modelled sizes
    want = _two_level_all_reduce(intra, inter, n, g, size / 4 * 2)
    got = collective_seconds(target.collectives, "nccl-bf16", size, ("all_reduce",))
    assert got == pytest.approx(want, rel=0.01), seed
    # the cost model's communication is the model's all-reduce of the whole model's float32 bytes; compute unchanged
    knobs = ProblemSettings(gradient_mode="bf16", optimizer="adamw8bit")
    before, after = build_problem(profile, knobs), build_problem(target, knobs)
    params = float(profile.header["model"]["parameters"])
    want = _two_level_all_reduce(intra, inter, n, g, params * 2)
    assert after.communication_seconds == pytest.approx(want, rel=0.01), seed
    assert after.base_seconds - after.communication_seconds == pytest.approx(
        before.base_seconds - before.communication_seconds, rel=1e-9)
    # a sharded state (FSDP2's, sdp4bit gradients' own layout) is 1/N per rank; replicas keep the whole
    whole = state_parts(profile, "sdp4bit", "adamw8bit", "fp32")
    assert state_per_rank(target, "sdp4bit", "adamw8bit", "fp32")["masters"] == pytest.approx(whole["masters"] / n)
    assert state_per_rank(target, "sdp4bit", "adamw8bit", "fp32")["weights"] == pytest.approx(whole["weights"] / n)
    assert state_per_rank(target, "bf16", "adamw8bit", "fp32")["weights"] == pytest.approx(whole["weights"])


def test_default_network_is_the_profiles_fitted_link(two_rank_profile):
    profile = load_profile(two_rank_profile)
    target, whatif = retarget(profile, 2, 2)
    assert whatif.network.name == "profile" and whatif.fit is not None
    measured = profile.collectives
    row = measured[(measured["path"] == "nccl-bf16") & (measured["op"] == "all_reduce")].iloc[-1]
    got = collective_seconds(target.collectives, "nccl-bf16", float(row["message_bytes"]), ("all_reduce",))
    assert got == pytest.approx(float(row["seconds"]), rel=0.1)  # the synthetic table is nearly linear in bytes


def test_one_rank_profile_needs_a_network(tmp_path):
    _, rng = fresh_rng()
    profile = load_profile(write_profile(tmp_path / "one", rng, micro_batch=2, seq_len=40))
    with pytest.raises(ValueError, match="--network"):
        retarget(profile, 8, 8)
    target, whatif = retarget(profile, 16, 8, "nvlink-h100+ib-ndr400")
    assert whatif.fit is None and any("wire time only" in e for e in whatif.extrapolated())
    assert target.world_size == 16 and whatif.network.inter == parse_network("ib-ndr400").inter


def _search(profile_dir, out, *extra):
    return main(["search", "--profile", str(profile_dir), "--budget", "1GiB", "--out", str(out), "--quiet",
                 "--front-budgets", "0", *extra])


def test_search_world_size_writes_a_plan_that_says_it_is_a_what_if(two_rank_profile, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert _search(two_rank_profile, out, "--world-size", "16", "--node-size", "4", "--network",
                   "nvlink-a100+roce-100g") == 0
    printed = capsys.readouterr().out
    assert "what-if: planned for 16 ranks (4 node(s) of 4), measured on 2" in printed
    assert "torchrun --nproc-per-node 4" in printed and "agoq.cli profile" in printed
    plan = load_plan(out)
    assert plan.dims().world_size in (1, 16) and plan.dims().data_ranks in (1, 16)
    w = plan.whatif
    assert (w.measured_world_size, w.world_size, w.node_size, w.nodes) == (2, 16, 4, 4)
    assert w.network["inter"]["bandwidth_bytes_per_second"] == pytest.approx(12.5e9)
    assert "IEEE 802.3" in w.network["source"] and w.fit["rows"] > 0 and w.extrapolated
    data = json.loads(out.read_text())
    assert data["schema"] == "agoq.plan/1.9" and data["whatif"]["check_first"].startswith("torchrun")
    assert "--world-size 16 --node-size 4" in data["whatif"]["check_then"] and "--nnodes 2" in w.check_then
    assert data["whatif"]["launch"].startswith("torchrun --nnodes 4 --nproc-per-node 4")
    assert data["whatif"]["launch"].endswith(data["launch"]["command"].split("--nproc-per-node 16 ", 1)[1])
    # without --world-size nothing changes: no what-if
    plain = tmp_path / "plain.json"
    assert _search(two_rank_profile, plain) == 0
    assert load_plan(plain).whatif is None and "what-if" not in capsys.readouterr().out


@pytest.mark.parametrize("extra,words", [
    (["--world-size", "6", "--node-size", "4"], "not a multiple of --node-size 4"),
    (["--world-size", "8", "--network", "fast-ethernet"], "unknown network"),
    (["--world-size", "8", "--network", "intra=5@1"], "both intra"),
    (["--world-size", "8", "--validate", "1"], "cannot be run here"),
])
def test_search_what_if_refusals(two_rank_profile, tmp_path, capsys, extra, words):
    out = tmp_path / "plan.json"
    assert _search(two_rank_profile, out, *extra) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not out.exists()


def test_sweep_rows_are_the_plans_the_command_writes(two_rank_profile, tmp_path):
    from agoq.search.whatif_sweep import sweep

    profile = load_profile(two_rank_profile)
    rows = sweep(profile, [1, 8], 4, "nvlink-h100+ib-ndr400", 2**30)
    assert [(r["world_size"], r["layout"]) for r in rows] == [(1, "replicated"), (8, "replicated"), (8, "fsdp"),
                                                             (8, "hsdp")]  # 8 ranks span nodes of 4
    out = tmp_path / "plan.json"
    assert _search(two_rank_profile, out, "--world-size", "8", "--node-size", "4", "--network",
                   "nvlink-h100+ib-ndr400", "--layout", "fsdp") == 0
    plan = load_plan(out)
    row = rows[2]
    # two solves of one problem: the first objective (step time) is solved to HiGHS's relative gap FIRST_GAP, under
    # a wall-clock limit, so the two may return choices within that gap of each other (a busy machine can stop one
    # earlier); both fit the budget
    from agoq.search.milp_model import FIRST_GAP

    assert row["found"] and row["step_seconds"] == pytest.approx(plan.predicted.step_seconds, rel=FIRST_GAP)
    assert row["tokens_per_second"] == pytest.approx(plan.decision.tokens_per_second * 8, rel=FIRST_GAP)
    assert row["peak_bytes"] <= 2**30 and max(plan.predicted.peak_bytes_per_stage) <= 2**30
