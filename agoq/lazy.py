"""Public names that load their home module on first use (PEP 562), so that importing a package, or a light
module of it, does not import the kernels behind its other names. Imports nothing heavy itself."""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, homes: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for `package`'s module: a name of `homes` (name -> its home module) is read from its
    home on first use and kept in the package, so the next read does not come back here."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
