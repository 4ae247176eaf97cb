"""The oneDNN cap for CPUs that advertise AMX (agoq.cpu_isa)."""

import os
import subprocess
import sys

import pytest

from agoq.cpu_isa import SAFE_ISA, avoid_amx, cpu_flags

AMX_CPUINFO = """processor\t: 0
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
PLAIN_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"


def test_flags_are_read_from_every_flags_line():
    assert {"amx_tile", "avx512_bf16", "fpu"} <= cpu_flags(AMX_CPUINFO)
    assert "amx_tile" not in cpu_flags(PLAIN_CPUINFO)


@pytest.mark.parametrize("text,expected", [(AMX_CPUINFO, True), (PLAIN_CPUINFO, False)])
def test_cap_set_only_on_amx(tmp_path, text, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    env = {}
    assert avoid_amx(env, str(info)) is expected
    assert (env.get("ONEDNN_MAX_CPU_ISA") == SAFE_ISA) is expected


def test_user_choice_kept(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(AMX_CPUINFO)
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert avoid_amx(env, str(info)) is False and env == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert avoid_amx({}, str(tmp_path / "missing")) is False


def test_bf16_linear_in_a_fresh_process():
    """What crashed on AMX hosts: a bf16 nn.Linear forward right after `import agoq`, in a process that
    starts without the variable. It must finish, agree with float64, and carry the cap where AMX is
    advertised."""
    code = (
        "import os, torch, agoq\n"
        "torch.manual_seed(0)\n"
        "lin = torch.nn.Linear(67, 45).to(torch.bfloat16)\n"
        "x = torch.randn(13, 67).to(torch.bfloat16)\n"
        "y = lin(x).double()\n"
        "ref = x.double() @ lin.weight.double().T + lin.bias.double()\n"
        "err = ((y - ref).norm() / ref.norm()).item()\n"
        "assert err < 1e-2, err\n"
        "flags = open('/proc/cpuinfo').read() if os.path.exists('/proc/cpuinfo') else ''\n"
        "assert ('amx' not in flags) or os.environ.get('ONEDNN_MAX_CPU_ISA') == 'AVX512_CORE_BF16'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
