"""Keep oneDNN off instruction sets that fault on this machine.

Some CPUs advertise AMX (`amx_tile`, `amx_bf16` in /proc/cpuinfo) on hosts that do not grant a process
the AMX tile state; oneDNN then picks its AMX kernels for bf16 matrix products and the process dies with
`Illegal instruction`. oneDNN reads `ONEDNN_MAX_CPU_ISA` once, the first time it dispatches a kernel, so
setting it before any bf16 CPU work caps oneDNN at AVX-512 with bf16 (what such CPUs also have), which
computes the same products. A value the user set is left as it is.
"""

from __future__ import annotations

import os

SAFE_ISA = "AVX512_CORE_BF16"
_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The union of the `flags` lines of a /proc/cpuinfo text."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return flags


def avoid_amx(environ: dict | None = None, cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Cap oneDNN below AMX when the CPU advertises it; returns whether the cap was set here.

    `environ` defaults to os.environ. Nothing is changed when neither variable is needed or the user
    already chose a value for one of them.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _VARIABLES):
        return False
    try:
        with open(cpuinfo_path) as f:
            flags = cpu_flags(f.read())
    except OSError:
        return False
    if not any(flag.startswith("amx") for flag in flags):
        return False
    for name in _VARIABLES:
        environ[name] = SAFE_ISA
    return True
