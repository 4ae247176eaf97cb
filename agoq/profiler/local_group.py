"""A process group of local processes for a measurement every rank takes part in: `run_on_local_group` starts
`world_size` spawned processes (NCCL with one GPU each, or gloo on the CPU), each joins the group and calls
`work(rank, *args)`, and rank 0's returned dict comes back. Plain processes report through files in a temporary
folder (no queues or semaphores left behind at exit); each leaves by os._exit, skipping the interpreter-exit
destructors of communication threads. What `work` raises comes back as a RuntimeError naming `what`.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import threading
import traceback
import warnings
from typing import Callable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out_dir: str, use_cuda: bool, work: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames collectives across versions
    tqdm.set_lock(threading.RLock())  # this process leaves by os._exit, which would strand a semaphore
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if use_cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    try:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        result = work(rank, *args)
    except BaseException:  # reported to the parent, whatever it was
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def run_on_local_group(work: Callable, args: tuple, world_size: int, use_cuda: bool, what: str) -> dict:
    """`work(rank, *args)` (a module-level function returning a JSON-ready dict) on every rank of a local group of
    `world_size`; returns rank 0's dict. ValueError when CUDA is asked for and there are fewer GPUs; RuntimeError
    when rank 0 left no result or raised."""
    import multiprocessing

    import torch

    if use_cuda and torch.cuda.device_count() < world_size:
        raise ValueError(f"--world-size {world_size} needs {world_size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(rank, world_size, port, out_dir, use_cuda, work, args))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        path = os.path.join(out_dir, "0.json")
        if not os.path.exists(path):
            raise RuntimeError(f"{what}: rank 0 left no result (exit codes {[p.exitcode for p in procs]})")
        with open(path) as f:
            result = json.load(f)
    if "error" in result:
        raise RuntimeError(f"{what} failed on rank 0:\n{result['error']}")
    return result


__all__ = ["run_on_local_group", "free_port"]
