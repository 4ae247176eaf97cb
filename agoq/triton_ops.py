"""agoq's kernels as `torch.library.triton_op`s: one operator per kernel, that Inductor compiles through.

A triton_op's body allocates its outputs with torch ops and launches the Triton kernel through
`torch.library.wrap_triton(kernel)[grid](...)`. Eagerly the body runs as the op's kernel (the launch goes straight
to Triton); under torch.compile, AOTAutograd traces the body instead of keeping an opaque call, so Inductor sees
the kernel itself and launches it from its generated code: no dispatcher round trip and no Python wrapper per call.

`triton_operator` adds what agoq needs on top of `torch.library.triton_op`:
  * a CPU kernel (the torch reference), registered for "cpu" on the same op;
  * a fake implementation of its own (the body's Triton path would not run on fake CPU tensors);
  * a `decompose(*args)` predicate: the body is traced only where it holds (CUDA tensors, and whatever else the
    op needs, e.g. no seed drawn on the host); elsewhere the op stays one opaque call, run by its device kernel.

AGOQ_TRITON_OPS=0 in the environment (read at import) keeps every op opaque under torch.compile, as custom ops
were before: a switch for comparing the two. On a torch without `triton_op` (< 2.6), or where the triton package
is not installed (the CPU build of torch does not bring it), the ops are custom ops: their CPU kernels need no
Triton, and nothing here imports it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

DECOMPOSE = os.environ.get("AGOQ_TRITON_OPS", "1") != "0"
HAS_TRITON = importlib.util.find_spec("triton") is not None  # looked up, not imported
HAS_TRITON_OP = HAS_TRITON and hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")


def _decomposition_disabled_by_export() -> bool:
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:
        return False
    return custom_triton_ops_decomposition_disabled()


def triton_operator(name: str, body: Callable, *, cpu: Callable, fake: Callable,
                    decompose: Callable[..., bool]):
    """Define operator `name` from `body` (annotated: the schema is inferred from it) as a triton_op.

    `body` runs for every device but the CPU (in practice CUDA); `cpu` is the CPU kernel, `fake` the shape
    function, `decompose(*args, **kwargs)` says whether torch.compile may trace into the body for these inputs.
    Returns the op (a CustomOpDef: register_autograd etc. work as on a custom op)."""
    if not HAS_TRITON_OP:
        op = torch.library.custom_op(name, body, mutates_args=())
        op.register_kernel("cpu", cpu)
        op.register_fake(fake)
        return op
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    op = torch.library.triton_op(name, body, mutates_args=())
    op.register_kernel("cpu", cpu)
    op.register_fake(fake)  # replaces the body, which triton_op registers as the fake

    def functional_rule(mode, func, types, args, kwargs):
        # triton_op's own rule traces the body for every input; this one only where `decompose` allows
        plain = all(t is torch.Tensor or issubclass(t, (FakeTensor, FunctionalTensor)) for t in types)
        if plain and DECOMPOSE and not _decomposition_disabled_by_export() and decompose(*args, **kwargs):
            with mode:
                return body(*args, **kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, functional_rule)
    return op


def register_kernels(name: str, kernels: list) -> None:
    """Name the Triton kernels behind op `name` for AOTAutograd's cache key (its source scan cannot follow
    agoq's lazy imports of the kernel modules). Best effort: a private table of torch's."""
    try:
        import torch._library.triton as library_triton

        table = library_triton.triton_ops_to_kernels
    except (ImportError, AttributeError):
        return
    known = table.setdefault(name, [])
    for kernel in kernels:
        if all(kernel is not k for k in known):
            known.append(kernel)


def wrap(kernel):
    """`torch.library.wrap_triton(kernel)`: traceable under torch.compile; inside an eager triton_op call (where
    torch disables wrapping) and under the Triton interpreter, the kernel itself."""
    return torch.library.wrap_triton(kernel) if HAS_TRITON_OP else kernel
