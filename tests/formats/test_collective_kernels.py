"""profile.json `collective_kernels` (agoq.formats.collective_kernels): its one writer's section is read back as
written, a profile without it reads as one whose kernels were not timed, and a malformed one is refused naming its
field."""

import json
import random

import pytest

from agoq.formats.collective_kernels import PATHS, section
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
