"""The `agoq` command: main job, policy printing, and clear errors on bad input."""

import json
import subprocess
import sys

import pytest

from agoq.runtime.activations.policy import ActivationPolicy
from agoq.cli import main


def test_activations_writes_report(tmp_path, capsys, seed):
    out = tmp_path / "sub" / "report.json"
    seq = 19 + seed % 13
    code = main(["activations", "--quiet", "--seq", str(seq), "--batch", "3", "--dtype", "fp32",
                 "--policy", "bf16,int8,agoq-paper", "--repeats", "1", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "agoq-paper" in text and "int8" in text
    report = json.loads(out.read_text())
    by_name = {r["policy"]: r for r in report["reports"]}
    assert set(by_name) == {"bf16", "int8", "agoq-paper"}
    assert by_name["bf16"]["grad_rel_error"] == 0.0
    assert 0 < by_name["int8"]["grad_rel_error"] < by_name["agoq-paper"]["grad_rel_error"]
    assert max(by_name["agoq-paper"]["total_bytes"], by_name["int8"]["total_bytes"]) < by_name["bf16"]["total_bytes"]
    for r in report["reports"]:
        assert r["prediction_error"] < 0.02


def test_policy_file_round_trip(tmp_path):
    path = tmp_path / "policy.json"
    assert main(["policy", "--in-flight", "11,9,7,5", "--layers", "8", "--out", str(path)]) == 0
    assert main(["activations", "--quiet", "--seq", "11", "--repeats", "1", "--policy", str(path)]) == 2  # 3 layers
    assert main(["policy", "--in-flight", "7,5,3", "--layers", "3", "--out", str(tmp_path / "p3.json")]) == 0
    policy = ActivationPolicy.from_dict(json.loads(path.read_text()))
    assert [policy.settings(i)["silu_input"] for i in range(8)] == [4, 4, 4, 4, 6, 6, 8, 8]
    # a policy file is accepted by `agoq activations`
    assert main(["activations", "--quiet", "--seq", "11", "--repeats", "1", "--policy", str(tmp_path / "p3.json")]) == 0


@pytest.mark.parametrize("argv, message", [
    (["activations", "no-such-model"], "no-such-model"),
    (["activations", "--policy", "int9"], "unknown activation policy preset"),
    (["activations", "--seq", "100000"], "max_position_embeddings"),
    (["policy", "--in-flight", "3,2"], "--layers"),
    (["activations", "missing.json"], "missing.json"),
])
def test_bad_input_exits_2_with_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--seq", "-3"), ("--repeats", "x"), ("--layers", "0")])
def test_non_positive_sizes_rejected_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["activations", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: expected a positive integer" in capsys.readouterr().err


def test_console_entry_point_help():
    res = subprocess.run([sys.executable, "-m", "agoq.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "activations" in res.stdout and "policy" in res.stdout


def test_bare_command_prints_help_and_version(capsys):
    assert main([]) == 0
    assert "the loop:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("agoq ")


def test_version_read_from_metadata_beside_a_folder_named_agoq(tmp_path):
    """`python -m agoq.train` runs from folders that hold a folder named agoq (a checkout's docs, a run):
    the recorded version comes from the installed package's metadata, not from whatever `agoq` is found."""
    (tmp_path / "agoq").mkdir()
    (tmp_path / "agoq" / "notes.txt").write_text("not a package")
    code = "from agoq.environment import agoq_version, software_versions; print(agoq_version(), software_versions()['agoq'])"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = res.stdout.split()
    assert a == b and a[0].isdigit()
