"""The host link (agoq.profiler.host_link): pinnable bytes against /proc/meminfo read here, no measurement off the
GPU, the profile's timing.host_link written and read back, malformed ones refused naming the field, and on a GPU
rates a real PCIe/NVLink-C2C link reaches."""

import json
import math
import os
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from agoq.formats.profile import load_profile, write_profile_files
from agoq.profiler import host_link as host_link_module
from agoq.profiler.host_link import measure_host_link, pinnable_bytes

MEMINFO = Path("/proc/meminfo")
LINK = {"d2h_bytes_per_second": 2.4e10, "h2d_bytes_per_second": 2.1e10, "bytes_per_copy": 256 << 20,
        "compute_slowdown": 0.03, "pinnable_bytes": 64 << 30}


def mem_available_bytes() -> int:
    match = re.search(r"^MemAvailable:\s+(\d+) kB$", MEMINFO.read_text(), re.M)
    assert match, "MemAvailable not in /proc/meminfo"
    return int(match.group(1)) * 1024


@pytest.mark.skipif(not MEMINFO.is_file(), reason="no /proc/meminfo")
def test_pinnable_bytes_is_half_of_mem_available():
    before = mem_available_bytes()
    got = pinnable_bytes()
    after = mem_available_bytes()
    assert isinstance(got, int)
    # available memory moves between reads: within the two reads' range, give or take 64 MiB
    assert min(before, after) // 2 - (64 << 20) <= got <= max(before, after) // 2 + (64 << 20)


def test_pinnable_bytes_without_meminfo(monkeypatch):
    def no_file(*args, **kwargs):
        raise FileNotFoundError("no /proc here")

    monkeypatch.setattr(host_link_module, "open", no_file, raising=False)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        free = None
    got = pinnable_bytes()
    if free is not None:
        assert abs(got - free // 2) <= 64 << 20  # free pages move between reads too

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(host_link_module.os, "sysconf", no_sysconf)
    assert pinnable_bytes() == 0


def test_no_measurement_off_the_gpu():
    assert measure_host_link("cpu") is None
    assert measure_host_link(torch.device("cpu"), nbytes=1 << 20, repeats=1) is None


def test_cpu_profile_has_no_host_link(tiny_profile):
    out, header = tiny_profile
    assert "host_link" not in header["timing"]
    assert "host_link" not in json.loads((out / "profile.json").read_text())["timing"]
    assert load_profile(out).host_link is None
    assert not [f for f in header["failures"] if f["what"] == "host link"]


def rewrite(tiny_profile, folder: Path, host_link) -> Path:
    """The tiny profile written again by the profile writer, with timing.host_link = `host_link` (... : absent)."""
    src, _ = tiny_profile
    header = json.loads((src / "profile.json").read_text())
    header.pop("files")
    timing = dict(header.get("timing") or {})
    if host_link is ...:
        timing.pop("host_link", None)
    else:
        timing["host_link"] = host_link
    header["timing"] = timing
    rows = pd.read_parquet(src / "profile.parquet").to_dict("records")
    write_profile_files(folder, header, rows)
    return folder


def test_host_link_round_trip(tiny_profile, tmp_path):
    data = load_profile(rewrite(tiny_profile, tmp_path / "p", dict(LINK)))
    assert data.host_link == LINK
    assert isinstance(data.host_link["bytes_per_copy"], int) and isinstance(data.host_link["pinnable_bytes"], int)
    assert data.header["timing"]["layer_forward_seconds"] == \
        json.loads((tiny_profile[0] / "profile.json").read_text())["timing"]["layer_forward_seconds"]
    assert load_profile(rewrite(tiny_profile, tmp_path / "absent", ...)).host_link is None
    assert load_profile(rewrite(tiny_profile, tmp_path / "null", None)).host_link is None  # null: not measured


BAD = [
    ("d2h_bytes_per_second", 0),
    ("h2d_bytes_per_second", 0.0),
    ("d2h_bytes_per_second", -2.0e10),
    ("h2d_bytes_per_second", math.nan),  # written as null
    ("d2h_bytes_per_second", math.inf),  # written as null
    ("h2d_bytes_per_second", "fast"),
    ("d2h_bytes_per_second", True),
    ("d2h_bytes_per_second", None),
    ("h2d_bytes_per_second", ...),  # missing
    ("pinnable_bytes", -1),
    ("pinnable_bytes", 1.5),
    ("pinnable_bytes", math.nan),
    ("pinnable_bytes", ...),
    ("bytes_per_copy", 0),
    ("compute_slowdown", -0.1),
    ("compute_slowdown", ...),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_malformed_host_link_refused(tiny_profile, tmp_path, field, value):
    link = dict(LINK)
    if value is ...:
        del link[field]
    else:
        link[field] = value
    folder = rewrite(tiny_profile, tmp_path / "p", link)
    with pytest.raises(ValueError, match=rf"timing\.host_link\.{field}:") as e:
        load_profile(folder)
    assert "agoq profile" in str(e.value)


@pytest.mark.parametrize("link", [[2.4e10, 2.1e10], "24 GB/s", 5])
def test_host_link_not_an_object_refused(tiny_profile, tmp_path, link):
    with pytest.raises(ValueError, match=r"timing\.host_link: must be an object"):
        load_profile(rewrite(tiny_profile, tmp_path / "p", link))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_on_the_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()  # cuBLAS's workspace for this stream is made once, by the first matmul, and kept
    del a
    allocated = torch.cuda.memory_allocated(device)
    got = measure_host_link(device, nbytes=64 << 20, repeats=2)
    assert set(got) == {"d2h_bytes_per_second", "h2d_bytes_per_second", "bytes_per_copy", "compute_slowdown",
                        "pinnable_bytes"}
    for key in ("d2h_bytes_per_second", "h2d_bytes_per_second"):
        assert math.isfinite(got[key]) and got[key] > 1e9, (key, got[key])
    assert got["bytes_per_copy"] == 64 << 20
    assert math.isfinite(got["compute_slowdown"]) and got["compute_slowdown"] >= 0
    assert isinstance(got["pinnable_bytes"], int) and got["pinnable_bytes"] >= 0
    assert torch.cuda.memory_allocated(device) == allocated  # everything it allocated is freed
