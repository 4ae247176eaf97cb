"""The Profile folder: schema of profile.json and profile.parquet (docs/formats.md), read with pandas alone."""

import json
import math

import pandas as pd

from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.runtime.activations.policy import KINDS, RECOMPUTABLE
from agoq.files import json_safe
from agoq.formats.profile import COLUMNS, load_profile
from agoq.models import build, fingerprint
from agoq.runtime.quant.qtensor import quantized_nbytes


def test_json_header(tiny_profile):
    out, header = tiny_profile
    data = json.loads((out / "profile.json").read_text())
    assert data["schema"] == "agoq.profile/1.1"
    for key in ("model", "settings", "hardware", "software", "date", "memory", "pipeline", "failures"):
        assert key in data, key
    model = build("llama-tiny")
    assert data["model"]["fingerprint"] == fingerprint(model)
    assert data["model"]["num_layers"] == 3 and data["model"]["parameters"] == model.num_parameters()
    assert data["model"]["config"]["hidden_size"] == 64
    s = data["settings"]
    assert (s["seq_len"], s["micro_batch"], s["bits"], s["formats"], s["batches"]) == (23, 3, [2, 4, 8],
                                                                                      ["int", "nf4"], 2)
    assert data["failures"] == []
    assert data["sensitivity"]["replay_noise_floor"] == 0.0  # CPU backward is deterministic
    forward = data["timing"]["layer_forward_seconds"]
    assert len(forward) == 3 and all(t > 0 for t in forward)
    assert data["pipeline"]["in_flight"]["1f1b"] == [2, 1]
    assert data["hardware"]["device"] == "cpu"
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temporary files left


def test_table_rows_and_columns(tiny_profile):
    out, _ = tiny_profile
    table = pd.read_parquet(out / "profile.parquet")
    for col in ("layer", "kind", "option", "bits", "format", "shape", "bytes", "quant_error", "sqnr_db",
                "sensitivity", "extra_seconds", "quantize_seconds", "dequantize_seconds", "recompute_seconds"):
        assert col in table.columns, col
    per_kind = {k: 1 + 3 + 1 + (k in RECOMPUTABLE) for k in KINDS}  # 16; 8, 4, 2 int; 4 nf4; recompute
    assert len(table) == 3 * sum(per_kind.values())
    assert not table.duplicated(["layer", "kind", "option", "format"]).any()
    keep = table[table.option == "16"]
    assert (keep.sensitivity == 0).all() and (keep.quant_error == 0).all() and (keep.extra_seconds == 0).all()
    assert (keep.sqnr_db == math.inf).all()
    quant = table[table.format.isin(["int", "nf4"])]
    assert (quant.quant_error > 0).all() and (quant.sensitivity > 0).all()
    assert (quant.extra_seconds > 0).all()
    plain = quant[quant.kind != "attention"]
    assert plain.recompute_seconds.isna().all()
    assert ((plain.quantize_seconds + plain.dequantize_seconds - plain.extra_seconds).abs() < 1e-12).all()
    att = quant[quant.kind == "attention"]  # quantized q, k, v: backward reruns the attention forward
    assert (att.recompute_seconds > 0).all()
    assert ((att.quantize_seconds + att.dequantize_seconds + att.recompute_seconds - att.extra_seconds).abs()
            < 1e-12).all()
    rec = table[table.option == "recompute"]
    assert set(rec.kind) == set(RECOMPUTABLE) and (rec.bytes == 0).all() and (rec.recompute_seconds > 0).all()
    assert (rec.bits == 0).all()
    assert set(table.loc[table.format == "nf4", "bits"]) == {4}
    q = table[(table.format != "bf16")]
    assert (q.sqnr_db[q.quant_error > 0] - (-20 * q.quant_error[q.quant_error > 0].map(math.log10))).abs().max() < 1e-9


def test_bytes_against_prediction_and_tracker(tiny_profile):
    out, _ = tiny_profile
    table = pd.read_parquet(out / "profile.parquet")
    assert (table.bytes_measured == table.bytes).all()  # the saved-tensor tracker on the real runs
    shape = LayerShape(3, 23, 64, 176, 4, 2, 16, 4)
    t = 3 * 23
    expect = {  # independent counts: packed codes + one float32 scale per 128 values
        ("norm_input", "4"): 2 * quantized_nbytes(t * 64, 4, 128),
        ("silu_input", "2"): 2 * quantized_nbytes(t * 176, 2, 128),
        ("attention", "8"): quantized_nbytes(t * 64, 8, 128) + 2 * quantized_nbytes(t * 32, 8, 128),
        ("ffn2_input", "16"): t * 176 * 4,
        ("o_proj_input", "16"): 0,  # the attention output attention already keeps
        ("attention", "16"): sum(v for k, v in predict_layer_bytes(shape, None).items() if k == "attention"),
    }
    for (kind, option), nbytes in expect.items():
        rows = table[(table.kind == kind) & (table.option == option) & (table.format != "nf4")]
        assert len(rows) == 3 and (rows.bytes == nbytes).all(), (kind, option, rows.bytes.tolist(), nbytes)
    oproj = table[(table.kind == "o_proj_input") & (table.option == "16")]
    assert (oproj.bytes_unshared == t * 64 * 4).all()


def test_memory_section_on_cpu(tiny_profile):
    _, header = tiny_profile
    mem = header["memory"]
    model = build("llama-tiny")
    n = sum(p.numel() for p in model.parameters())
    assert mem["weights_bytes"] == 4 * n and mem["optimizer_bytes_adamw"] == 8 * n
    assert mem["master_bytes"] == 0  # float32 parameters are their own masters
    assert mem["fixed_bytes"] is None  # no allocator statistics on the CPU: not invented
    assert "workspace_bytes" not in mem  # calibrated only where the peak is measured
    head = mem["chunked_lm_head"]  # the chunked loss's shape and forward peak, as the profiled step ran it
    cfg = model.config
    t = header["settings"]["micro_batch"] * header["settings"]["seq_len"]
    assert (head["vocab"], head["hidden"], head["head_dim"], head["tokens"], head["elem_bytes"]) == \
        (cfg.vocab_size, cfg.hidden_size, cfg.head_dim, t, 4)
    assert head["seq"] == header["settings"]["seq_len"] and head["peak_bytes"] > 8 * cfg.vocab_size * cfg.hidden_size
    steps = {s["policy"]: s for s in mem["steps"]}
    assert set(steps) == {"bf16", "agoq-paper"}
    for s in steps.values():
        assert s["measured_peak_bytes"] is None
        assert s["predicted_activation_bytes"] == s["measured_activation_bytes"]
    assert steps["agoq-paper"]["predicted_activation_bytes"] < steps["bf16"]["predicted_activation_bytes"]


def test_search_reads_the_profile(tiny_profile):
    data = load_profile(tiny_profile[0])
    assert data.num_layers == 3 and data.in_flight("1f1b") == [2, 1]


def test_round_trip(tiny_profile):
    out, header = tiny_profile
    data = load_profile(out)
    assert data.header == json.loads(json.dumps(json_safe(header), default=str))
    assert data.header["files"] == {"table": "profile.parquet"}
    assert data.table[list(COLUMNS)].astype(str).equals(pd.read_parquet(out / "profile.parquet")[list(COLUMNS)]
                                                        .astype(str))


def test_csv_table_is_read(tiny_profile, tmp_path):
    """Profiles written as CSV (by versions that fell back to it without pyarrow) read the same."""
    import shutil

    out, header = tiny_profile
    copy = tmp_path / "csv"
    shutil.copytree(out, copy)
    pd.read_parquet(copy / "profile.parquet").to_csv(copy / "profile.csv", index=False)
    (copy / "profile.parquet").unlink()
    meta = json.loads((copy / "profile.json").read_text())
    meta["files"]["table"] = "profile.csv"
    (copy / "profile.json").write_text(json.dumps(meta))
    a, b = load_profile(out).table, load_profile(copy).table
    assert len(a) == len(b) and list(a.option) == list(b.option) and (a.bytes.values == b.bytes.values).all()
    assert ((a.sensitivity - b.sensitivity).abs() <= 1e-12 * a.sensitivity.abs().max()).all()


def _shipped_profiles():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return sorted(p.parent for folder in (root / "agoq" / "examples" / "profiles",
                                          root / "experiments" / "results" / "profiles")
                  for p in folder.glob("*/profile.json"))


def test_every_shipped_profile_loads():
    shipped = _shipped_profiles()
    assert len(shipped) >= 2  # the examples at least
    for folder in shipped:
        assert load_profile(folder).num_layers >= 1, folder


def test_a_profile_missing_a_required_section_is_refused(tmp_path):
    """A header without a section the search needs (memory: it would plan from the activations alone and give
    another answer; settings; model) or one of its keys is refused naming the file, what is missing and to run
    agoq profile again; the same profile with it loads."""
    import random
    import shutil

    import pytest

    from agoq.formats.profile import REQUIRED_SECTIONS

    source = random.choice(_shipped_profiles())
    cases = [(section, None) for section in REQUIRED_SECTIONS]
    cases += [(section, key) for section, keys in REQUIRED_SECTIONS.items() for key in keys]
    assert ("memory", None) in cases and ("memory", "weights_bytes") in cases
    for i, (section, key) in enumerate(cases):
        copy = tmp_path / f"p{i}"
        shutil.copytree(source, copy)
        header = json.loads((copy / "profile.json").read_text())
        if key is None:
            del header[section]
        else:
            del header[section][key]
        (copy / "profile.json").write_text(json.dumps(header))
        with pytest.raises(ValueError) as e:
            load_profile(copy)
        message = str(e.value)
        named = section if key is None else f"{section}.{key}"
        assert str(copy / "profile.json") in message and named in message and "agoq profile" in message, message
    assert load_profile(source).memory  # the original, untouched, loads
