"""Profiles of real models measured on real GPUs, shipped so that `agoq search` and the dashboard can plan for a real
model on a machine without a GPU (`agoq demo` copies them next to its own profile). Each folder is a Profile
(docs/formats.md) as `agoq profile` wrote it; `profiles()` lists them.
"""

from __future__ import annotations

from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "profiles"


def profiles() -> dict[str, Path]:
    """{name: folder} of the shipped example profiles."""
    return {p.name: p for p in sorted(PROFILES.iterdir()) if (p / "profile.json").is_file()}


__all__ = ["profiles", "PROFILES"]
