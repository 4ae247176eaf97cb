"""The kernel backends a test can run here: the torch references everywhere; Triton where it is installed
and there is a GPU or its interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU).

`BACKENDS` parametrizes a test over both, with the Triton case skipped (and reported as such) where it cannot
run; `needs_triton` marks a test that compares the two."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_missing() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "no GPU, and TRITON_INTERPRET is not 1"
    return None


TRITON_MISSING = _triton_missing()
needs_triton = pytest.mark.skipif(TRITON_MISSING is not None, reason=f"Triton backend: {TRITON_MISSING}")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
