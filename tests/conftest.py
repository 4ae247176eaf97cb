"""Test session setup: run the Triton kernels in the interpreter when there is no GPU.

TRITON_INTERPRET is read when kernels are decorated, so it is set here, before agoq is imported.
Importing agoq then caps oneDNN below AMX on CPUs where its AMX kernels fault (agoq.cpu_isa); torch
itself runs no oneDNN kernel at import, so the cap is in place before the first bf16 product.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import agoq  # noqa: E402,F401  (agoq.cpu_isa.avoid_amx runs on import)
