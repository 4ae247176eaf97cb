"""`import agoq` loads no kernels: the light modules (units, files) and the dashboard start without agoq's
kernel and operator modules or Triton, while every public name of `agoq` resolves on first use to the object
its home module defines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_PACKAGES = ("agoq.quant", "agoq.activations", "agoq.comm", "agoq.optim", "agoq.triton_ops", "agoq.models",
                   "agoq.train", "agoq.profiler", "triton")


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def test_light_modules_and_the_dashboard_load_no_kernels(tmp_path):
    done = _run(f"""
        import sys

        def loaded():
            return sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in {KERNEL_PACKAGES!r}))

        import agoq
        import agoq.units
        import agoq.files
        import dashboard.formats
        assert loaded() == [], loaded()
        from agoq.cli import main  # what `agoq dashboard` imports before it serves
        import dashboard.command
        import dashboard.app
        assert loaded() == [], loaded()
        agoq.quantized_nbytes  # the first read of a public name loads its home, and only then
        assert "agoq.quant" in loaded(), loaded()
        print("ok")
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_every_public_name_resolves_to_its_home_modules_object(tmp_path):
    """The reference is the explicit import list of each name from the module that defines it."""
    done = _run("""
        import agoq
        from agoq.activations import (KINDS, ActivationPolicy, apply_activation_policy, preset,
                                      remove_activation_policy, stage_aware_policy, stage_bits, track_saved_tensors)
        from agoq.comm import QuantizedGradients, quangrad_hook, quantized_all_reduce
        from agoq.comm.fsdp import fully_shard_quantized
        from agoq.comm.fsdp_collectives import TLQHSReduceScatter, use_quantized_reduce_scatter
        from agoq.quant import QTensor, dequantize, quantize, quantized_nbytes

        expected = {name: value for name, value in locals().items() if not name.startswith("_") and name != "agoq"}
        expected["__version__"] = agoq.__version__
        assert sorted(agoq.__all__) == sorted(expected), sorted(set(agoq.__all__) ^ set(expected))
        assert set(agoq.__all__) <= set(dir(agoq)), set(agoq.__all__) - set(dir(agoq))  # before any is read
        for name in agoq.__all__:
            assert getattr(agoq, name) is expected[name], name
        namespace = {}
        exec("from agoq import *", namespace)
        assert all(namespace[name] is expected[name] for name in agoq.__all__)
        try:
            agoq.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("an unknown name must raise AttributeError")
        print("ok")
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_the_commands_read_their_arguments_without_the_web_stack(tmp_path):
    """`agoq COMMAND --help` (and so every command) needs neither FastAPI nor uvicorn: only `agoq dashboard` serves
    (GPU images, for one, lack them)."""
    done = _run("""
        import contextlib, io, sys
        for name in ("fastapi", "uvicorn", "starlette"):
            sys.modules[name] = None  # importing them raises ModuleNotFoundError
        from agoq.cli import COMMANDS, main
        for argv in [["--help"]] + [[name, "--help"] for name in COMMANDS]:
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    main(argv)
                except SystemExit as e:
                    assert e.code == 0, (argv, e.code)
        print("ok")
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
