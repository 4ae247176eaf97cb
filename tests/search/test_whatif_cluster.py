"""What-if plans as complete cluster plans (agoq.search.whatif): FSDP2's int8 weight all-gather priced by the network
model on its own path, the nodes in the plan's parallel section, and a profile's multi-rank layout steps carried to
N ranks (the exposed seconds measured at W, re-priced by the model from W to N)."""

from __future__ import annotations

import json
import random

import pytest

from agoq.cli import main
from agoq.formats.plan import load_plan
from agoq.formats.profile import load_profile
from agoq.search.collective_times import collective_seconds
from agoq.search.layouts import fsdp_exposed_seconds, unit_sizes
from agoq.search.network import Kernel, Link
from agoq.search.price import Configuration, price
from agoq.search.problem import ProblemSettings
from agoq.search.whatif import modelled_table, retarget
from tests.search.synthetic_profile import write_profile


def _ring(link: Link, p: int, nbytes: float) -> float:
    """By hand: a ring all-gather of p ranks, (p - 1) steps and (p - 1) / p of the bytes; nothing for one rank."""
    return 0.0 if p == 1 else (p - 1) * link.latency + (p - 1) / p * nbytes / link.bandwidth


def _int8_gather(intra: Link, inter: Link, n: int, g: int, message_bytes: float, code_bytes: float = 1.0) -> float:
    """By hand: the two-level all-gather of int8 codes (`code_bytes` per value: 0.5 for int4) + a float32 scale per
    256 values (inter first, over 1/g)."""
    nbytes = message_bytes / 4 * (code_bytes + 4 / 256)
    return _ring(inter, n // g, nbytes / g) + _ring(intra, g, nbytes)


def _cluster(rng):
    g = rng.choice([2, 4, 8])
    n = g * rng.randint(2, 16)
    intra = Link(rng.uniform(50, 500) * 1e9, rng.uniform(1, 10) * 1e-6)
    inter = Link(rng.uniform(0.5, 50) * 1e9, rng.uniform(3, 30) * 1e-6)
    spec = (f"intra={intra.bandwidth / 1e9}@{intra.latency * 1e6},"
            f"inter={inter.bandwidth / 1e9}@{inter.latency * 1e6}")
    return n, g, intra, inter, spec


@pytest.fixture
def two_rank(tmp_path, seed):
    rng = random.Random(seed)
    return write_profile(tmp_path / "p", rng, num_layers=3, micro_batch=3, seq_len=37, world_size=2,
                         collectives=True, fsdp_collectives=True, link_bytes_per_second=rng.uniform(3e8, 3e9),
                         layer_forward=True, compile_modes=("eager", "compiled"), step_peaks=True,
                         optimizer_step_bytes=rng.randrange(10**5, 10**6))


def test_the_int8_weight_gather_is_priced_by_the_network_model(two_rank, seed):
    rng = random.Random(seed + 1)
    profile = load_profile(two_rank)
    n, g, intra, inter, spec = _cluster(rng)
    target, whatif = retarget(profile, n, g, spec)
    size = 4.0 * rng.randint(10**5, 10**9)
    got = collective_seconds(target.collectives, "int8-weights", size, ("all_gather",))
    assert got == pytest.approx(_int8_gather(intra, inter, n, g, size), rel=0.01), seed
    got4 = collective_seconds(target.collectives, "int4-weights", size, ("all_gather",))
    assert got4 == pytest.approx(_int8_gather(intra, inter, n, g, size, 0.5), rel=0.01), seed
    assert any("int8 weight all-gather: wire time only" in e for e in whatif.extrapolated())
    assert any("int4 weight all-gather: wire time only" in e for e in whatif.extrapolated())
    # FSDP2's exposed communication reads it, and its kernels where the network has them
    kernel = Kernel(rng.uniform(1e-5, 1e-4), rng.uniform(1e-11, 1e-9))
    table = modelled_table(whatif.network.with_kernels({**whatif.network.kernels,
                                                        ("all_gather", "int8-weights"): kernel}), n, g)
    units = unit_sizes(profile.model_config(), int(profile.header["model"]["parameters"]), profile.num_layers)
    layers, fb = profile.num_layers, rng.uniform(1e-4, 1e-1)
    ag_l = _int8_gather(intra, inter, n, g, 4.0 * units.layer) + kernel.seconds(4.0 * units.layer)
    ag_r = _int8_gather(intra, inter, n, g, 4.0 * units.root) + kernel.seconds(4.0 * units.root)
    rs_l, rs_r = (collective_seconds(table, "sdp4bit", 4.0 * u, ("reduce_scatter",)) for u in (units.layer, units.root))
    want = layers * (max(0.0, ag_l - fb / layers / 3) + max(0.0, ag_l + rs_l - 2 * fb / layers / 3)) \
        + 2 * ag_r + rs_r
    got = fsdp_exposed_seconds(table, "sdp4bit", units, layers, fb, "int8")
    assert got["all_gather_layer"] == pytest.approx(ag_l, rel=0.01) and got["exposed"] == pytest.approx(want, rel=0.01)
    # the profile's own table (no int8 path): the bf16 gather of as many bytes, as before
    bf16_table = profile.collectives
    plain = fsdp_exposed_seconds(bf16_table, "sdp4bit", units, layers, fb, "int8")["all_gather_layer"]
    assert plain == pytest.approx(collective_seconds(bf16_table, "nccl-bf16", 4.0 * units.layer * (1 + 4 / 256) / 2,
                                                     ("all_gather",)), rel=1e-9)


def _search(profile_dir, out, *extra):
    return main(["search", "--profile", str(profile_dir), "--budget", "1TB", "--out", str(out), "--quiet",
                 "--front-budgets", "0", *extra])


def test_what_if_plans_give_their_nodes_and_pick_a_quantized_gather_on_a_slow_network(two_rank, tmp_path, seed):
    rng = random.Random(seed + 2)
    g = rng.choice([2, 4])
    n = g * rng.randint(2, 8)
    slow = f"intra={rng.uniform(100, 400):.1f}@3,inter={rng.uniform(0.05, 0.2):.3f}@20"
    for layout, gradients in (("replicated", "bf16"), ("fsdp", "sdp4bit")):
        out = tmp_path / f"{layout}.json"
        assert _search(two_rank, out, "--world-size", str(n), "--node-size", str(g), "--network", slow,
                       "--layout", layout, "--gradients", gradients) == 0
        plan = load_plan(out)
        assert plan.parallel.ranks_per_node == g and plan.dims().data_ranks == n, (seed, layout)
        assert json.loads(out.read_text())["parallel"]["ranks_per_node"] == g
    # FSDP2 + TLq-HS across slow nodes: the int4 gather (about a quarter of the bytes) is the plan, the cheapest
    fsdp = load_plan(tmp_path / "fsdp.json")
    assert fsdp.parallel.weight_gather == "int4", seed
    target, _ = retarget(load_profile(two_rank), n, g, slow)
    knobs = {k: v for k, v in fsdp.decision.knobs.items() if k in ("micro_batch", "grad_accum", "optimizer", "master")}
    priced = {gather: price(target, Configuration(ProblemSettings(
        layout="fsdp", gradient_mode="sdp4bit", weight_gather=gather, compile_mode=fsdp.training.compile,
        layer_stage=(0,) * 3, allow_offload=False, **knobs))).communication_seconds for gather in ("bf16", "int8", "int4")}
    assert priced["int4"] < priced["int8"] < priced["bf16"], (seed, priced)


# -------------------------------------------------------------------------------- layout steps carried to N

MEASURED = (("replicated", "bf16", "bf16"), ("replicated", "quangrad8", "bf16"), ("fsdp", "bf16", "bf16"),
            ("fsdp", "sdp4bit", "int8"), ("fsdp", "sdp4bit", "int4"))


def _knobs(layout, gradients, gather, **kw):
    return ProblemSettings(layout=layout, gradient_mode=gradients, weight_gather=gather, layer_stage=(0, 0, 0),
                           allow_offload=False, **kw)


def _measured_knobs(layout, gradients, gather, compile_mode):
    return _knobs(layout, gradients, gather, micro_batch=3, grad_accum=1, optimizer="adamw8bit", master="fp32",
                  compile_mode=compile_mode)


def _with_layout_steps(folder, rng, compile_mode):
    """Layout steps drawn about the model's price at 2 ranks: (rows, {key: (exposed, margin, modelled comm)})."""
    plain = load_profile(folder)
    rows, truth = [], {}
    for layout, gradients, gather in MEASURED:
        at = price(plain, Configuration(_measured_knobs(layout, gradients, gather, compile_mode)))
        exposed = rng.uniform(0.2, 3.0) * max(at.communication_seconds, 1e-3)
        margin = rng.randrange(-at.peak_bytes // 7, at.peak_bytes // 3)
        truth[(layout, gradients, gather)] = (exposed, margin, at.communication_seconds)
        rows.append({"layout": layout, "gradients": gradients, "weight_gather": gather, "compile": compile_mode,
                     "micro_batch": 3, "grad_accum": 1, "optimizer": "adamw8bit", "master": "fp32", "steps": 6,
                     "step_seconds": at.step_seconds - at.communication_seconds + exposed,
                     "peak_bytes": at.peak_bytes + margin})
    header = json.loads((folder / "profile.json").read_text())
    header["layout_steps"] = {"version": 1, "world_size": 2, "rows": rows}
    (folder / "profile.json").write_text(json.dumps(header))
    return truth


def test_a_what_if_carries_the_measured_exposure_and_reprices_it_at_n(two_rank, seed):
    rng = random.Random(seed + 3)
    compile_mode = rng.choice(["eager", "compiled"])
    plain = load_profile(two_rank)
    truth = _with_layout_steps(two_rank, rng, compile_mode)
    calibrated = load_profile(two_rank)
    n, g, _, _, spec = _cluster(rng)
    before, _ = retarget(plain, n, g, spec)  # the network model at N, no layout steps
    after, whatif = retarget(calibrated, n, g, spec)
    assert whatif.layout_steps == len(MEASURED) and any("re-priced" in e for e in whatif.extrapolated())
    for key, (exposed, margin, modelled_w) in truth.items():
        configs = [Configuration(_measured_knobs(*key, compile_mode)),
                   Configuration(_knobs(*key, micro_batch=1, grad_accum=3, compile_mode=compile_mode)),
                   Configuration(_knobs(*key, micro_batch=3, grad_accum=2, compile_mode=compile_mode),
                                 checkpoint_layers=(rng.randrange(3),))]
        for config in configs:
            model_n, got = price(before, config), price(after, config)
            # hidden at W = modelled_w - exposed stays hidden at N
            want = max(0.0, model_n.communication_seconds - (modelled_w - exposed))
            assert got.communication_seconds == pytest.approx(want, rel=1e-9, abs=1e-12), (seed, key, config)
            assert got.step_seconds == pytest.approx(
                model_n.step_seconds - model_n.communication_seconds + want, rel=1e-9), (seed, key, config)
            assert abs(got.peak_bytes - (model_n.peak_bytes + margin)) <= 2, (seed, key, config)
    # at N = W over the profile's own fitted link, the what-if is the plain calibration within the fit's residuals
    same, _ = retarget(calibrated, 2, 2)
    for key in truth:
        config = Configuration(_measured_knobs(*key, compile_mode))
        here, there = price(calibrated, config), price(same, config)
        assert there.step_seconds == pytest.approx(here.step_seconds, rel=0.05), (seed, key)
