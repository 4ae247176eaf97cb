"""What a newcomer types: sizes with exponents, a profile.json given for its folder, negative clips, a folder
as --data, and the mode of the files agoq writes."""

import json
import os
import random
import stat

import pytest

from agoq.commands.arguments import non_negative_float
from agoq.files import write_json
from agoq.formats.profile import load_profile
from agoq.units import parse_size
from tests.search.synthetic_profile import write_profile


@pytest.mark.parametrize("text,expected", [("1e9", 10**9), ("2.5e3KiB", 2560000), ("1E3", 1000), ("4096", 4096),
                                           ("1.5GB", 1_500_000_000)])
def test_sizes_with_exponents(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1e", "e9", "-1e9", "1e-3GB"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size(text)


def test_negative_clip_is_refused():
    import argparse

    assert non_negative_float("0") == 0.0 and non_negative_float("0.75") == 0.75
    for bad in ("-1", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            non_negative_float(bad)


def test_profile_json_names_its_folder(tmp_path):
    folder = write_profile(tmp_path / "p", random.Random(7), num_layers=3)
    a, b = load_profile(folder), load_profile(folder / "profile.json")
    assert a.header == b.header and a.table.equals(b.table)


def test_folder_as_data_is_refused(tmp_path):
    from agoq.train.data import load_corpus

    with pytest.raises(ValueError, match="is a folder"):
        load_corpus(str(tmp_path), None)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        path = write_json(tmp_path / f"f{mask}.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert json.loads(path.read_text()) == {"a": 1}


def test_unwritable_place_is_named_without_a_temporary_file(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: make the parent a file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        target = blocker / "plan.json"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = locked / "plan.json"
    with pytest.raises(ValueError, match=f"cannot write {target}") as info:
        write_json(target, {"a": 1})
    assert ".tmp" not in str(info.value)
