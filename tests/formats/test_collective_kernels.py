"""profile.json `collective_kernels` (agoq.formats.collective_kernels): its one writer's section is read back as
written, a profile without it reads as one whose kernels were not timed, and a malformed one is refused naming its
field."""

import json
import random

import pytest

from agoq.formats.collective_kernels import INT4_LEVEL, PATHS, PATHS_V1, kernel_rows, section
from agoq.formats.profile import add_collective_kernels, load_profile
from tests.search.synthetic_profile import write_profile


def _rows(rng):
    return [{"op": op, "path": path, "message_bytes": 4 * rng.randrange(1, 10**7), "seconds": rng.uniform(1e-6, 1.0)}
            for op, path in PATHS for _ in range(3)]


def _with_section(folder, rng):
    header = json.loads((folder / "profile.json").read_text())
    add_collective_kernels(folder, header, section(_rows(rng), 2, 2, "test-gpu", 5))
    return folder


def test_the_section_reads_back_as_written_and_its_absence_as_none(tmp_path, seed):
    rng = random.Random(seed)
    folder = write_profile(tmp_path / "p", rng, micro_batch=2, seq_len=40)
    assert load_profile(folder).collective_kernels() == []
    rows = _rows(rng)
    header = json.loads((folder / "profile.json").read_text())
    written = add_collective_kernels(folder, header, section(rows, 2, 2, "test-gpu", 5))
    profile = load_profile(folder)
    assert profile.collective_kernels() == rows and profile.header == json.loads(json.dumps(written))
    assert profile.header["schema"] == header["schema"]  # additive: the schema stays
    with pytest.raises(ValueError, match="seconds"):
        section([{**rows[0], "seconds": float("nan")}], 2, 2, "cpu", 3)


@pytest.mark.parametrize("field, value, words", [
    ("version", 9, "version"), ("rows", [{"op": "all_reduce", "path": "nccl-bf16", "message_bytes": 4,
                                          "seconds": 1.0}], "(op, path)"),
    ("rows", [{"op": "all_reduce", "path": "tlq4", "message_bytes": 4, "seconds": -1.0}], "seconds"),
    ("world_size", 0, "world_size")])
def test_a_malformed_section_is_refused_naming_its_field(tmp_path, seed, field, value, words):
    rng = random.Random(seed)
    folder = _with_section(write_profile(tmp_path / "p", rng, micro_batch=2, seq_len=40), rng)
    header = json.loads((folder / "profile.json").read_text())
    header["collective_kernels"][field] = value
    (folder / "profile.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match="collective_kernels") as e:
        load_profile(folder)
    assert words in str(e.value)


def test_version_1_and_version_2_sections_both_read_and_only_version_2_names_the_int4_level(tmp_path, seed):
    """A version 1 section (written before TLq-HS's int4 level was timed) reads as written, without that path; the
    version 2 one `section` writes holds it; a version 1 row naming it, or any row of an unknown path, is refused
    with the section, the row and the paths it may name in the message."""
    rng = random.Random(seed)
    rows = _rows(rng)
    assert INT4_LEVEL in PATHS and INT4_LEVEL not in PATHS_V1 and set(PATHS) - set(PATHS_V1) == {INT4_LEVEL}
    older = [r for r in rows if (r["op"], r["path"]) != INT4_LEVEL]
    for version, mine in ((1, older), (2, rows)):
        folder = write_profile(tmp_path / f"v{version}", rng, micro_batch=2, seq_len=40)
        header = json.loads((folder / "profile.json").read_text())
        header["collective_kernels"] = {"version": version, "world_size": 2, "node_size": 2, "device": "test-gpu",
                                        "repeats": 5, "rows": mine}
        (folder / "profile.json").write_text(json.dumps(header))
        assert load_profile(folder).collective_kernels() == mine
    assert section(rows, 2, 2, "cpu", 3)["version"] == 2
    bad = rng.randrange(len(older) + 1)
    v1 = {"collective_kernels": {"version": 1, "world_size": 2, "node_size": 2, "device": "cpu", "repeats": 3,
                                 "rows": older[:bad] + [{**older[0], "op": INT4_LEVEL[0], "path": INT4_LEVEL[1]}]}}
    with pytest.raises(ValueError) as e:
        kernel_rows(v1)
    assert f"collective_kernels.rows[{bad}]" in str(e.value) and "sdp4bit-int4-level" in str(e.value)
    assert "version 1" in str(e.value) and "profile again" in str(e.value)
    v2 = {"collective_kernels": {**v1["collective_kernels"], "version": 2,
                                 "rows": rows[:bad] + [{**rows[0], "path": "sdp4bit-int2-level"}]}}
    with pytest.raises(ValueError) as e:
        kernel_rows(v2)
    assert f"collective_kernels.rows[{bad}]: (op, path) must be one of" in str(e.value)
    assert "'sdp4bit-int2-level'" in str(e.value) and "reduce_scatter sdp4bit-int4-level" in str(e.value)
    v2["collective_kernels"]["version"] = True  # not a version number
    with pytest.raises(ValueError, match="version"):
        kernel_rows(v2)
