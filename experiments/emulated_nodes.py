"""One rank of an emulated node: the GPUs of one host split into nodes of G ranks as NCCL sees them, so that a
4-GPU host runs as 2 nodes of 2 (the "2 nodes of 2" runs of DESIGN.md 4.3).

NCCL takes ranks whose host ids are equal for one node: between them it uses its P2P (NVLink) and shared-memory
transports, between nodes its network transport (with NCCL_NET=Socket and NCCL_SOCKET_IFNAME=lo: TCP on loopback,
standing in for the network between nodes). This script sets NCCL_HOSTID to one id per LOCAL_RANK // G, then runs
the module given by -m as `python -m` would, with the arguments after it. Run it under torchrun, with the
environment of experiments.train_runs.NODES_ENV:

    NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0 AGOQ_ALLREDUCE_TRANSPORT=collectives \
      torchrun --standalone --nproc-per-node 4 experiments/emulated_nodes.py --node-size 2 -m agoq.train probe ...

Check with NCCL_DEBUG=INFO that the ranks of a pair connect by P2P and the pairs by the socket ("via NET/Socket").
agoq's one-node symmetric-memory all-reduce ignores NCCL's host ids (it would see one node of 4 and use NVLink),
hence AGOQ_ALLREDUCE_TRANSPORT=collectives.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: emulated_nodes.py --node-size G -m MODULE [ARGS...] (under torchrun)"


def host_id(local_rank: int, node_size: int) -> str:
    """NCCL_HOSTID of local rank `local_rank` in nodes of `node_size` ranks."""
    return f"agoq-emulated-node-{local_rank // node_size}"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "--node-size" or argv[2] != "-m":
        raise SystemExit(USAGE)
    try:
        node_size = int(argv[1])
    except ValueError:
        node_size = 0
    if node_size < 1:
        raise SystemExit(f"--node-size must be a positive whole number of ranks, got {argv[1]!r}; {USAGE}")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        raise SystemExit(f"LOCAL_RANK is not set: run this under torchrun; {USAGE}")
    os.environ["NCCL_HOSTID"] = host_id(int(local_rank), node_size)
    sys.argv = [argv[3], *argv[4:]]
    runpy.run_module(argv[3], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
