"""Run a test body in several gloo processes on this machine and collect what each rank returns."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a collective left waiting by a failed peer errors out instead of hanging the test run
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180))
    succeeded = False
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
        succeeded = True
    except BaseException:  # report the failure to the parent, whatever it was
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
    try:
        if succeeded:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        # The result is on disk. Leave without running interpreter-exit destructors, where a
        # background communication thread torn down late can abort the process
        # ("terminate called without an active exception") after everything succeeded.
        os._exit(0)


def run_workers(fn, world: int, *args) -> list:
    """Run fn(rank, world, *args) in `world` gloo processes; returns each rank's result, in rank order.

    fn must be a module-level function (it is pickled). A failure on any rank fails the caller with
    that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, _free_port(), out_dir, fn, args), nprocs=world, join=True,
                           start_method="spawn")
        results = []
        for rank in range(world):
            record = torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False)
            if "error" in record:
                raise AssertionError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["ok"])
        return results
