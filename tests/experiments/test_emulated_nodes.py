"""experiments/emulated_nodes.py and the "nodes" transport of experiments/train_runs: one NCCL host id per node of
G local ranks, the module run with its arguments, and launch lines that go through the wrapper only over nodes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import emulated_nodes
from experiments.train_runs import NODES_ENV, SOCKETS_ENV, launcher, transport_env

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, local_rank: str | None, *argv: str) -> subprocess.CompletedProcess:
    (tmp_path / "echo_rank.py").write_text(  # a module that reports what it was run with
        "import json, os, sys\n"
        "print(json.dumps({'host': os.environ.get('NCCL_HOSTID'), 'argv': sys.argv[1:], 'name': __name__}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NCCL_HOSTID")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    if local_rank is not None:
        env["LOCAL_RANK"] = local_rank
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "emulated_nodes.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=120)


def test_each_rank_gets_its_nodes_host_id_and_the_module_its_arguments(tmp_path):
    rng = random.Random(int(os.environ.get("AGOQ_TEST_SEED", "0")))
    size = rng.randint(2, 5)
    ranks = rng.sample(range(3 * size), 3)
    for rank in ranks:
        got = _run(tmp_path, str(rank), "--node-size", str(size), "-m", "echo_rank", "probe", "--steps", "7")
        assert got.returncode == 0, got.stderr
        out = json.loads(got.stdout)
        assert out == {"host": f"agoq-emulated-node-{rank // size}", "argv": ["probe", "--steps", "7"],
                       "name": "__main__"}
    ids = {emulated_nodes.host_id(r, size) for r in range(3 * size)}
    assert len(ids) == 3  # three nodes, each of `size` ranks


@pytest.mark.parametrize("argv, local_rank, said", [
    (["--node-size", "0", "-m", "echo_rank"], "0", "--node-size must be a positive whole number"),
    (["--node-size", "two", "-m", "echo_rank"], "0", "--node-size must be a positive whole number"),
    (["-m", "echo_rank"], "0", "usage: emulated_nodes.py"),
    (["--node-size", "2", "-m", "echo_rank"], None, "LOCAL_RANK is not set: run this under torchrun"),
])
def test_bad_use_is_refused_with_what_to_do(tmp_path, argv, local_rank, said):
    got = _run(tmp_path, local_rank, *argv)
    assert got.returncode != 0 and said in got.stderr and "Traceback" not in got.stderr


def test_only_the_nodes_transport_goes_through_the_wrapper_and_keeps_p2p_inside_a_node():
    assert launcher(1, "nodes") == [sys.executable, "-m", "agoq.train"]
    plain = launcher(4, "sockets", "agoq.cli")
    assert plain[-2:] == ["-m", "agoq.cli"] and "--nproc-per-node=4" in plain
    nodes = launcher(4, "nodes", "agoq.cli", node_size=2)
    assert nodes[-5:] == [str(ROOT / "experiments" / "emulated_nodes.py"), "--node-size", "2", "-m", "agoq.cli"]
    with pytest.raises(SystemExit, match="do not make several nodes"):
        launcher(3, "nodes", node_size=2)
    with pytest.raises(SystemExit, match="do not make several nodes"):
        launcher(2, "nodes", node_size=2)  # one node is no network
    env = transport_env("nodes")
    assert env is NODES_ENV and env["NCCL_NET"] == "Socket" and env["AGOQ_ALLREDUCE_TRANSPORT"] == "collectives"
    assert "NCCL_P2P_DISABLE" not in env and "NCCL_SHM_DISABLE" not in env  # NVLink inside a node
    assert SOCKETS_ENV["NCCL_P2P_DISABLE"] == "1"
