"""Where a Profile or Run was made: the hardware and the software versions it records.

Imports torch only inside the functions that read it: `agoq --version` reads agoq_version() alone."""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def hardware(device: torch.device | str, count: int) -> dict:
    """{"device", "name", "memory_bytes", "count", "cpu_count"}: the GPU's name and memory in bytes (None on
    the CPU), with `count` devices."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device.index or 0)
        return {"device": "cuda", "name": props.name, "memory_bytes": props.total_memory,
                "count": count, "cpu_count": os.cpu_count()}
    return {"device": "cpu", "name": platform.processor() or platform.machine(), "memory_bytes": None,
            "count": count, "cpu_count": os.cpu_count()}


def agoq_version() -> str:
    """The installed agoq's version, from its package metadata (not from whatever `agoq` folder an import
    happens to find first, such as one in the working directory)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agoq")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def software_versions() -> dict:
    """{"agoq", "torch", "python", "triton", "transformers"}: version strings, None where not installed."""
    import torch

    out = {"agoq": agoq_version(), "torch": torch.__version__, "python": platform.python_version()}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out
