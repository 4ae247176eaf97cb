"""Test session setup: run the Triton kernels in the interpreter when there is no GPU.

TRITON_INTERPRET is read when kernels are decorated, so it is set here, before agoq is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
