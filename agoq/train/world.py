"""The process group of a run: this process's rank, the world's size and ranks per node, and two small collectives
the loop needs (`World`); `join_world` joins torchrun's group or runs one process."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist



@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    backend: str | None = None
    initialised_here: bool = False

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def gather_ints(self, value: int, device: torch.device) -> list[int]:
        """`value` of every rank, in rank order."""
        if self.size == 1:
            return [value]
        dev = device if self.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([value], dtype=torch.int64, device=dev)
        out = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine)
        return [int(t) for t in out]

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when `flag` is true on at least one (one small all-reduce; every rank calls it)."""
        if self.size == 1:
            return bool(flag)
        dev = device if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def join_world(device_hint: str | None) -> World:
    """The process group: the existing one, one from torchrun's environment, or a single process."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                     int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())), dist.get_backend())
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    use_cuda = torch.cuda.is_available() and (device_hint is None or device_hint.startswith("cuda"))
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return World(dist.get_rank(), dist.get_world_size(), local_rank,
                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")), backend, True)


__all__ = ["World", "join_world"]
