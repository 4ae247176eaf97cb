"""The CPU build of torch brings no Triton, and `pip install -e .` installs none: the README's first command
(`agoq --help`, `agoq demo`) must run without it. Each check runs in a fresh interpreter in which importing
triton fails as it does where the package is missing, and asserts that nothing imported it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BLOCK_TRITON = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # `import triton` raises ModuleNotFoundError; importlib.util.find_spec gives None
""")


def _run_without_triton(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "check.py"
    script.write_text(BLOCK_TRITON + textwrap.dedent(body)
                      + "\nassert not [m for m, v in sys.modules.items() if v is not None and m.split('.')[0] == 'triton']\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_blocker_blocks(tmp_path):
    """The check itself can fail: an import of triton under the blocker is an error."""
    done = _run_without_triton("import triton\n", tmp_path)
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr and "triton" in done.stderr


def test_help_and_every_command_help_without_triton(tmp_path):
    done = _run_without_triton("""
        import contextlib, io
        from agoq.cli import COMMANDS, main
        for argv in [["--help"]] + [[name, "--help"] for name in COMMANDS]:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    main(argv)
                except SystemExit as e:
                    assert e.code == 0, (argv, e.code)
            assert "usage: agoq" in out.getvalue(), argv
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Triton not available" not in done.stderr, done.stderr[-3000:]


def test_cpu_training_path_without_triton(tmp_path):
    """Quantize/dequantize, LAAQ's fused ops, QuanGrad and the fused 8-bit AdamW step on CPU tensors: the torch
    references run, and they agree with float64 arithmetic."""
    done = _run_without_triton("""
        import torch
        from agoq.runtime.quant import dequantize, quantize
        from agoq.runtime.optim.fused_adamw import grad_norm_sq
        torch.manual_seed(1234)
        x = torch.randn(3, 517)
        y = dequantize(quantize(x, bits=8, block=64))
        assert (y - x).abs().max() <= x.abs().max() / 127 * 1.01, (y - x).abs().max()
        grads = [torch.randn(37, 11), torch.randn(5)]
        expected = sum(float((g.double() ** 2).sum()) for g in grads)
        assert abs(float(grad_norm_sq(grads)) - expected) <= 1e-9 * expected
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_demo_without_triton(tmp_path):
    """The README's main job, on its defaults, in an interpreter without Triton; its record (agoq-demo.json) lists
    every file and folder it wrote, so `--force` would replace exactly those."""
    done = _run_without_triton(f"""
        from agoq.cli import main
        if __name__ == "__main__":  # the profile's two collective processes are spawned: they import this file
            code = main(["demo", "--out", {str(tmp_path / "demo")!r}, "--quiet", "--steps", "4"])
            assert code == 0, code
    """, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    out = tmp_path / "demo"
    parts = json.loads((out / "agoq-demo.json").read_text())["parts"]
    recorded = {*parts, *(c for claim in parts.values() for c in claim["created"]),
                *(f"{part}/{p}" for part, claim in parts.items() for p in claim["entries"])}
    assert recorded == {p.relative_to(out).as_posix() for p in out.rglob("*")} - {"agoq-demo.json"}
    assert {"profile", "search", "runs/baseline", "runs/plan"} <= set(parts)
