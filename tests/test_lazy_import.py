"""`import agoq` loads no kernels: the light modules (units, files) and the dashboard start without agoq's
kernel and operator modules or Triton, while every public name of `agoq` (and of `agoq.models`) resolves on first
use to the object its home module defines. The commands that compute nothing with torch (`agoq --version`,
`--help`, `agoq search`, the dashboard and its plan service) run without importing it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_PACKAGES = ("agoq.runtime.quant", "agoq.runtime.activations", "agoq.runtime.comm", "agoq.runtime.optim", "agoq.triton_ops", "agoq.models",
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
        assert "agoq.runtime.quant" in loaded(), loaded()
        print("ok")
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_every_public_name_resolves_to_its_home_modules_object(tmp_path):
    """The reference is the explicit import list of each name from the module that defines it."""
    done = _run("""
        import agoq
        from agoq.runtime.activations import (KINDS, ActivationPolicy, apply_activation_policy, preset,
                                      remove_activation_policy, stage_aware_policy, stage_bits, track_saved_tensors)
        from agoq.runtime.comm import QuantizedGradients, quangrad_hook, quantized_all_reduce
        from agoq.runtime.comm.fsdp import fully_shard_quantized
        from agoq.runtime.comm.fsdp_collectives import TLQHSReduceScatter, use_quantized_reduce_scatter
        from agoq.runtime.comm.fsdp_weight_gather import apply_weight_gather
        from agoq.runtime.quant import QTensor, dequantize, quantize, quantized_nbytes

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


def test_the_models_public_names_resolve_to_their_home_modules_objects(tmp_path):
    done = _run("""
        import sys
        import agoq.models
        assert "torch" not in sys.modules  # the package imports none of its homes
        from agoq.models.config import PRESETS, LlamaConfig, ModelSpec, resolve_config
        assert "torch" not in sys.modules  # nor do the configs
        from agoq.models.factory import build, fingerprint
        from agoq.models.llama import LlamaForCausalLM

        expected = {name: value for name, value in locals().items() if name[0] != "_" and name not in ("agoq", "sys")}
        assert set(agoq.models.__all__) <= set(expected), set(agoq.models.__all__) - set(expected)
        for name, value in expected.items():
            assert getattr(agoq.models, name) is value, name
        print("ok")
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_the_commands_that_compute_nothing_with_torch_run_without_it(tmp_path):
    """`agoq --version`, `agoq --help`, every `agoq COMMAND --help`, a whole `agoq search` (profile, cost model,
    MILP, plan files) and the dashboard (its app, its pages and a plan from its plan service) in one fresh process:
    torch is never imported. A finder records where an import of torch came from (and lets it happen, so that no
    `except ImportError` path stands in for the real one)."""
    profile = tmp_path / "root" / "probe"
    shutil.copytree(REPO / "agoq" / "examples" / "profiles" / "probe-h100", profile)
    done = _run(f"""
        import contextlib, importlib.abc, io, json, sys, traceback
        from pathlib import Path

        HEAVY = ("torch", "triton", "transformers")
        step, imported = "start", []

        class Watch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HEAVY:
                    stack = [f for f in traceback.extract_stack() if not f.filename.startswith("<frozen")]
                    imported.append((step, name, "".join(traceback.format_list(stack))))
                return None  # the import goes on: only where it came from is recorded

        sys.meta_path.insert(0, Watch())
        from agoq.cli import COMMANDS, main

        def cli(argv):
            global step
            step = " ".join(argv)
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code
            assert code in (0, None), (argv, code)
            return out.getvalue()

        assert cli(["--version"]).startswith("agoq ")
        assert "search" in cli(["--help"])
        for name in COMMANDS:
            cli([name, "--help"])
        plan = Path({str(tmp_path / "out" / "plan.json")!r})
        cli(["search", "--profile", {str(profile)!r}, "--budget", "11GB", "--out", str(plan), "--quiet"])
        assert plan.is_file(), "agoq search wrote no plan"

        step = "dashboard"
        from fastapi.testclient import TestClient
        from dashboard.app import create_app

        with TestClient(create_app({str(profile.parent)!r}), client=("127.0.0.1", 40123)) as client:
            assert client.get("/api/index").status_code == 200
            assert client.get("/").status_code == 200
            answer = client.post("/api/plan", json={{"profile": "probe", "budget": "11GB"}})
            assert answer.status_code == 200, answer.text
            assert answer.json()["plan"]["layers"] == json.loads(plan.read_text())["layers"]  # the search's plan
        assert not imported, "torch (or Triton, transformers) was imported by " + imported[0][0] + ":\\n" + imported[0][2]
        assert "torch" not in sys.modules
        print("ok")
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-5000:]
    assert done.stdout.strip().endswith("ok"), done.stdout[-2000:]
