"""A what-if from a profile with the quantized collectives' kernels timed in one process (profile.json
`collective_kernels`, agoq.formats.collective_kernels): each quantized path priced at its wire time plus the timed
kernel where no measured collective gave one (agoq.search.whatif.retarget), wire time only without the section, and
an older profile priced bit for bit as before."""

import json
import random

import numpy as np
import pytest

from agoq.formats.collective_kernels import INT4_LEVEL, PATHS, PATHS_V1
from agoq.formats.profile import load_profile
from agoq.search.collective_times import collective_seconds
from agoq.search.network import Kernel, WIRE_BYTES
from agoq.search.network_fit import fit_collectives, fit_timed_kernels
from agoq.search.network_spec import parse_network
from agoq.search.whatif import MODEL_SIZES, modelled_table, retarget
from tests.search.synthetic_profile import write_profile

SPEC = "nvlink-h100+ib-ndr400"


def _affine_kernels(rng) -> dict:
    """Fresh (fixed seconds, seconds per value) per path."""
    return {key: (rng.uniform(5e-6, 5e-5), rng.uniform(1e-11, 1e-9)) for key in PATHS}


def _with_section(folder, kernels: dict, rng, layout_rows=None, version=2):
    """Add a collective_kernels section of `version` whose rows lie exactly on each path's fixed + per_value x n
    (version 1: only its paths, no int4 level)."""
    sizes = sorted(4 * rng.randrange(10**4, 10**7) for _ in range(3))
    header = json.loads((folder / "profile.json").read_text())
    header["collective_kernels"] = {
        "version": version, "world_size": 2, "node_size": 2, "device": "test-gpu", "repeats": 5,
        "rows": [{"op": op, "path": path, "message_bytes": b, "seconds": f + p * b / 4}
                 for (op, path), (f, p) in kernels.items() if version > 1 or (op, path) in PATHS_V1
                 for b in sizes]}
    if layout_rows is not None:
        header["schema"] = "agoq.profile/1.1"
        header["layout_steps"] = {"version": 1, "world_size": 1, "rows": layout_rows}
    (folder / "profile.json").write_text(json.dumps(header))
    return folder


def _tlq_hs_wire(network, world: int, node: int, message_bytes: float) -> float:
    """By hand: int8 all-to-all over the node's G ranks, then int4 all-to-all over the M nodes of the 1/G."""
    values, nodes = message_bytes / 4, world // node
    intra, inter = network.intra, network.inter
    inside = (node - 1) * intra.latency + (node - 1) / node * values * (1 + 4 / 128) / intra.bandwidth
    across = (nodes - 1) * inter.latency + (nodes - 1) / nodes * values / node * (0.5 + 4 / 128) / inter.bandwidth
    return inside + across


def test_a_one_rank_profile_prices_tlq_hs_by_wire_plus_its_timed_kernels(tmp_path, seed):
    """Across nodes: wire + K8(n) + K4(n / G) from a version 2 section; K8(n) alone from a version 1 one (whose
    notes say the int4 level's kernels are not in the price); the wire alone without the section."""
    rng = random.Random(seed)
    kernels = _affine_kernels(rng)
    bare = load_profile(write_profile(tmp_path / "bare", rng, micro_batch=2, seq_len=40))
    timed = load_profile(_with_section(write_profile(tmp_path / "timed", rng, micro_batch=2, seq_len=40),
                                       kernels, rng))
    older = load_profile(_with_section(write_profile(tmp_path / "v1", rng, micro_batch=2, seq_len=40),
                                       kernels, rng, version=1))
    network = parse_network(SPEC)
    world, node = 8 * rng.randrange(2, 5), 8
    size = MODEL_SIZES[rng.randrange(20, len(MODEL_SIZES) - 20)]
    fixed, per_value = kernels[("reduce_scatter", "sdp4bit")]
    fixed4, per_value4 = kernels[INT4_LEVEL]
    wire = _tlq_hs_wire(network, world, node, size)
    int8 = fixed + per_value * size / 4
    int4 = fixed4 + per_value4 * size / 4 / node  # the node's 1/G of the n values
    for profile, want in ((timed, wire + int8 + int4), (older, wire + int8), (bare, wire)):
        target, whatif = retarget(profile, world, node, SPEC)
        got = collective_seconds(target.collectives, "sdp4bit", size, ("reduce_scatter",))
        assert got == pytest.approx(want, rel=1e-9)
    target, whatif = retarget(timed, world, node, SPEC)
    assert set(whatif.timed_kernels) == set(PATHS) and whatif.fit is None
    notes = " ".join(whatif.extrapolated())
    assert "timed in one process on test-gpu" in notes and "wire time only" not in notes
    assert "TLq-HS's int4 level across nodes: its own kernels" in notes and "not in the price" not in notes
    _, whatif = retarget(older, world, node, SPEC)
    assert set(whatif.timed_kernels) == set(PATHS_V1)
    assert "TLq-HS's int4-level kernels are not in the price" in " ".join(whatif.extrapolated())
    assert any("wire time only" in e for e in retarget(bare, world, node, SPEC)[1].extrapolated())
    _, whatif = retarget(timed, node, node, SPEC)  # one node: no int4 level, nothing said of it
    assert "TLq-HS's int4" not in " ".join(whatif.extrapolated())


def test_timed_kernels_are_fitted_per_path(seed):
    rng = random.Random(seed)
    kernels = _affine_kernels(rng)
    sizes = sorted(rng.randrange(10**4, 10**8) * 4 for _ in range(3))
    exact = [{"op": o, "path": p, "message_bytes": b, "seconds": f + v * b / 4}
             for (o, p), (f, v) in kernels.items() for b in sizes]
    fitted = fit_timed_kernels(exact)
    for key, (f, v) in kernels.items():  # rows on a line give that line back
        assert fitted[key].fixed == pytest.approx(f, rel=1e-6) and fitted[key].per_value == pytest.approx(v, rel=1e-6)
    # noisy rows: the kernel is the least-squares line of the relative error (numpy's, where it is non-negative)
    noisy = [{**r, "seconds": r["seconds"] * rng.uniform(0.8, 1.25)} for r in exact]
    fitted = fit_timed_kernels(noisy)
    for key in kernels:
        mine = [r for r in noisy if (r["op"], r["path"]) == key]
        a = np.array([[1 / r["seconds"], r["message_bytes"] / 4 / r["seconds"]] for r in mine])
        solution = np.linalg.lstsq(a, np.ones(len(mine)), rcond=None)[0]
        if (solution >= 0).all():
            assert fitted[key].fixed == pytest.approx(solution[0], rel=1e-6, abs=1e-12)
            assert fitted[key].per_value == pytest.approx(solution[1], rel=1e-6)
        for r in mine:  # within its fit: no row off by more than the noise put in
            assert fitted[key].seconds(r["message_bytes"]) == pytest.approx(r["seconds"], rel=0.6)


def test_an_older_profile_prices_as_before_bit_for_bit(tmp_path, seed):
    rng = random.Random(seed)
    profile = load_profile(write_profile(tmp_path / "old", rng, micro_batch=2, seq_len=40))
    assert profile.collective_kernels() == []
    world, node = 16, 8
    target, whatif = retarget(profile, world, node, SPEC)
    assert whatif.timed_kernels == () and whatif.network.kernels == {}
    assert target.collectives.equals(modelled_table(parse_network(SPEC), world, node))


def test_a_multi_rank_fit_keeps_its_kernels_and_fills_only_missing_paths(tmp_path, seed):
    rng = random.Random(seed)
    kernels = _affine_kernels(rng)
    folder = write_profile(tmp_path / "two", rng, micro_batch=2, seq_len=40, world_size=2, collectives=True,
                           fsdp_collectives=True, link_bytes_per_second=rng.uniform(2e9, 2e10))
    profile = load_profile(_with_section(folder, kernels, rng))
    fit = fit_collectives(profile.collectives)
    target, whatif = retarget(profile, 16, 8, SPEC)
    timed = fit_timed_kernels(profile.collective_kernels())
    for key in PATHS:
        assert whatif.network.kernels[key] == (fit.kernels[key] if key in fit.kernels else timed[key])
    assert set(whatif.timed_kernels) == set(PATHS) - set(fit.kernels)
    assert target.collectives.equals(modelled_table(parse_network(SPEC).with_kernels({**timed, **fit.kernels}),
                                                    16, 8, tuple(sorted(whatif.timed_kernels))))


def test_a_gather_a_one_rank_layout_step_measured_takes_no_timed_kernel(tmp_path, seed):
    rng = random.Random(seed)
    row = {"layout": "fsdp", "gradients": "sdp4bit", "weight_gather": "int8", "compile": "eager", "policy": "bf16",
           "micro_batch": 2, "grad_accum": 1, "optimizer": "adamw8bit", "master": "fp32", "warmup_steps": 1,
           "steps": 3, "step_seconds": 0.07, "peak_bytes": None, "source": "profile"}
    folder = _with_section(write_profile(tmp_path / "p", rng, micro_batch=2, seq_len=40), _affine_kernels(rng),
                           rng, layout_rows=[row])
    _, whatif = retarget(load_profile(folder), 16, 8, SPEC)
    assert ("all_gather", "int8-weights") not in whatif.network.kernels  # the step carries its kernels
    assert ("all_gather", "int4-weights") in whatif.network.kernels
    assert ("reduce_scatter", "sdp4bit") in whatif.timed_kernels


def test_wire_bytes_are_the_models(seed):
    """The hand-written TLq-HS wire above uses the model's own bytes per value (a check of the check)."""
    assert WIRE_BYTES["sdp4bit-intra"] == 1 + 4 / 128 and WIRE_BYTES["sdp4bit-inter"] == 0.5 + 4 / 128
    assert Kernel(1.0, 2.0).seconds(8.0) == 5.0


def test_fsdps_price_takes_the_timed_kernels_out_of_what_hides(tmp_path, seed):
    """FSDP2 with TLq-HS, priced from a what-if's table whose TLq-HS kernels were timed in one process: where the
    layers' compute hides every wire, the exposed time is the layers' kernels, L x k_rs (k_rs = fixed + per value x
    a layer's values, from the section) plus the root's collectives; with no compute to hide under, it is the same
    as the table without its kernel column (the kernels are part of each collective's seconds)."""
    from agoq.search.layouts import fsdp_exposed_seconds, unit_sizes

    rng = random.Random(seed)
    kernels = _affine_kernels(rng)
    profile = load_profile(_with_section(write_profile(tmp_path / "timed", rng, micro_batch=2, seq_len=40),
                                         kernels, rng))
    world = rng.choice([3, 5, 6])
    target, whatif = retarget(profile, world, world, SPEC)
    assert ("reduce_scatter", "sdp4bit") in whatif.timed_kernels
    table = target.collectives
    bare = table.drop(columns=["kernel_seconds"])
    units = unit_sizes(profile.model_config(), int(profile.header["model"]["parameters"]), profile.num_layers)
    L = profile.num_layers
    fixed, per_value = kernels[("reduce_scatter", "sdp4bit")]
    k_rs = fixed + per_value * units.layer  # the float32 message of a layer: 4 x its values, per_value per value
    hidden = fsdp_exposed_seconds(table, "sdp4bit", units, L, 1e6)  # compute far longer than any collective
    root = 2 * hidden["all_gather_root"] + hidden["reduce_scatter_root"]
    assert hidden["exposed"] == pytest.approx(L * k_rs + root, rel=1e-6)
    assert fsdp_exposed_seconds(bare, "sdp4bit", units, L, 1e6)["exposed"] == pytest.approx(root, rel=1e-9)
    assert fsdp_exposed_seconds(table, "sdp4bit", units, L, 0.0)["exposed"] == pytest.approx(
        fsdp_exposed_seconds(bare, "sdp4bit", units, L, 0.0)["exposed"], rel=1e-9)


def test_a_multi_rank_fit_without_the_int4_level_adds_none_and_says_so(tmp_path, seed):
    """Kernels fitted to collectives measured on one node hold TLq-HS's int8 level only: across nodes its
    reduce-scatter is the wire + the fitted K8(n), and the notes say the int4 level's kernels are not in the price;
    with a version 2 section the timed K4(n / G) is added to that fitted K8."""
    rng = random.Random(seed)
    folder = write_profile(tmp_path / "two", rng, micro_batch=2, seq_len=40, world_size=2, collectives=True,
                           fsdp_collectives=True, link_bytes_per_second=rng.uniform(2e9, 2e10))
    profile = load_profile(folder)
    fit = fit_collectives(profile.collectives)
    assert ("reduce_scatter", "sdp4bit") in fit.kernels
    node = rng.choice([2, 4, 8])
    world, size = node * rng.randrange(2, 5), MODEL_SIZES[rng.randrange(20, len(MODEL_SIZES) - 20)]
    k8 = fit.kernels[("reduce_scatter", "sdp4bit")].seconds(size)
    wire = _tlq_hs_wire(parse_network(SPEC), world, node, size)
    target, whatif = retarget(profile, world, node, SPEC)
    assert collective_seconds(target.collectives, "sdp4bit", size, ("reduce_scatter",)) == pytest.approx(
        wire + k8, rel=1e-9)
    assert "TLq-HS's int4-level kernels are not in the price" in " ".join(whatif.extrapolated())
    kernels = _affine_kernels(rng)
    target, whatif = retarget(load_profile(_with_section(folder, kernels, rng)), world, node, SPEC)
    fixed4, per_value4 = kernels[INT4_LEVEL]
    assert collective_seconds(target.collectives, "sdp4bit", size, ("reduce_scatter",)) == pytest.approx(
        wire + k8 + fixed4 + per_value4 * size / 4 / node, rel=1e-9)
    assert "not in the price" not in " ".join(whatif.extrapolated())
