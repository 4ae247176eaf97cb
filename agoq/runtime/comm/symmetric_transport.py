"""Moving the 8-bit all-reduce's rows over NVLink through symmetric memory, without NCCL collectives.

Every rank of a single-node NCCL group maps one buffer of every other rank (torch's symmetric
memory). The all-reduce then needs no all-to-all and no all-gather: each rank quantizes the shard
that rank d owns straight into rank d's inbox, waits at a barrier, sums its own inbox, writes its
reduced shard into every rank's outbox, waits at a barrier, and dequantizes its outbox locally.
The two buffer sets alternate between calls, so two barriers per call are enough: a rank can only
reach the set it wrote two calls ago after every peer has passed a barrier that follows its reads.

Host time dominates small and mid-sized reductions (a dozen kernel launches and two barriers), so a
reduction that repeats on the same tensor (DDP's buckets, QuanGrad's buffer, a training step's
gradients) is captured in a CUDA graph on its second call and replayed from then on, one graph per
buffer set (AGOQ_ALLREDUCE_GRAPHS=0 turns this off).

`Workspace.get(group, row_bytes)` returns None where symmetric memory cannot be used (no CUDA, not
NCCL, ranks on several hosts, an older torch); callers then use the collectives.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

_WORKSPACES: dict[str, "Workspace"] = {}
MAX_GRAPHS = 64  # per workspace; the oldest is dropped beyond this
_DISABLED: set[str] = set()


def _single_node(group) -> bool:
    world = dist.get_world_size(group)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None:
        return int(local) >= world and dist.get_world_size() == world
    return torch.cuda.device_count() >= world and dist.get_world_size() == world


class Workspace:
    """Double-buffered inbox [W, row_bytes] and outbox [W, row_bytes] per rank, in symmetric memory."""

    def __init__(self, group, capacity: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.capacity = capacity
        self.set_bytes = 2 * self.world * capacity  # inbox + outbox
        self.buffer = symm_mem.empty(2 * self.set_bytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        self.handle = symm_mem.rendezvous(self.buffer, self.group)
        self.peers = [self.buffer if r == self.rank else
                      self.handle.get_buffer(r, (2 * self.set_bytes,), torch.uint8, 0) for r in range(self.world)]
        self.parity = 0
        self.tables: dict[tuple, torch.Tensor] = {}
        self.graphs: dict[tuple, object] = {}  # (key, parity) -> number of eager runs so far, or a CUDAGraph
        self.pool = None

    @staticmethod
    def get(group, row_bytes: int) -> "Workspace | None":
        """The group's workspace holding rows of `row_bytes` (grown collectively), or None if unusable."""
        if os.environ.get("AGOQ_ALLREDUCE_TRANSPORT", "auto") == "collectives":
            return None
        if not torch.cuda.is_available() or dist.get_backend(group) != "nccl":
            return None
        key = dist.get_backend(group) + ":" + str(id(group if group is not None else dist.group.WORLD))
        if key in _DISABLED:
            return None
        ws = _WORKSPACES.get(key)
        if ws is not None and ws.capacity >= row_bytes:
            return ws
        if not _single_node(group):
            _DISABLED.add(key)
            return None
        capacity = max(row_bytes, 2 * ws.capacity if ws is not None else 0)
        capacity = -(-capacity // 4096) * 4096
        try:
            _WORKSPACES.pop(key, None)
            ws = Workspace(group, capacity)
        except (ImportError, RuntimeError, AttributeError) as e:
            _DISABLED.add(key)
            warnings.warn(f"agoq: symmetric memory is not usable here ({e}); the 8-bit all-reduce uses NCCL "
                          "collectives instead (set AGOQ_ALLREDUCE_TRANSPORT=collectives to silence this)")
            return None
        _WORKSPACES[key] = ws
        return ws

    def flip(self) -> int:
        """Switch to the other buffer set; returns its index."""
        self.parity ^= 1
        return self.parity

    def inbox(self, rank: int, parity: int, rb: int) -> torch.Tensor:
        """Rank `rank`'s inbox [W, rb] of set `parity` (a peer's memory when rank is not ours)."""
        base = parity * self.set_bytes
        return self.peers[rank][base:base + self.world * rb].view(self.world, rb)

    def outbox(self, rank: int, parity: int, rb: int) -> torch.Tensor:
        """Rank `rank`'s outbox [W, rb] of set `parity`."""
        base = parity * self.set_bytes + self.world * self.capacity
        return self.peers[rank][base:base + self.world * rb].view(self.world, rb)

    def run(self, key: tuple, parity: int, body) -> None:
        """Run `body()` (the reduction for `key` on buffer set `parity`): eagerly the first time, then
        captured in a CUDA graph and replayed. The graph keeps the addresses it was captured with, so
        `key` must pin them (the tensor's address, size and dtype)."""
        if os.environ.get("AGOQ_ALLREDUCE_GRAPHS", "1") == "0" or torch.cuda.is_current_stream_capturing():
            body()
            return
        slot = (key, parity)
        entry = self.graphs.get(slot, 0)
        if isinstance(entry, int):
            if entry < 0:
                body()
                return
            if entry == 0:
                self.graphs[slot] = 1
                body()  # warm-up: compiles kernels and settles allocations outside capture
                return
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    body()
            except RuntimeError as e:  # capture refused: stay eager for this reduction
                warnings.warn(f"agoq: the 8-bit all-reduce could not be captured in a CUDA graph ({e}); "
                              "it runs eagerly")
                self.graphs[slot] = -1
                torch.cuda.synchronize()
                body()
                return
            self.graphs[slot] = entry = graph
        entry.replay()

    def staging(self, parity: int, rb: int) -> list[torch.Tensor]:
        """Local rows [W] for set `parity`: row d holds our shard for rank d before it is copied over
        (our own shard's row is our inbox row, which needs no copy)."""
        if not hasattr(self, "_staging"):
            self._staging = torch.empty(2, self.world, self.capacity, dtype=torch.uint8, device=self.buffer.device)
        rows = [self._staging[parity, d, :rb] for d in range(self.world)]
        rows[self.rank] = self.inbox(self.rank, parity, rb)[self.rank]
        return rows

    def table(self, which: str, parity: int, rb: int) -> torch.Tensor:
        """Addresses (int64, on this GPU) of the rows the kernels write, one per destination rank:
        "inbox" / "outbox": row `our rank` in every rank's box; "staging": our local staging rows;
        "own-outbox": just our own outbox row."""
        key = (which, parity, rb)
        if key not in self.tables:
            if which == "inbox":
                rows = [self.inbox(d, parity, rb)[self.rank] for d in range(self.world)]
            elif which == "outbox":
                rows = [self.outbox(d, parity, rb)[self.rank] for d in range(self.world)]
            elif which == "staging":
                rows = self.staging(parity, rb)
            else:
                rows = [self.outbox(self.rank, parity, rb)[self.rank]]
            self.tables[key] = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64,
                                            device=self.buffer.device)
        return self.tables[key]

    def barrier(self, channel: int = 0) -> None:
        """Every rank's earlier work on this stream is done and visible before anyone goes on. Barriers
        that may run at the same time (on different streams) must use different channels."""
        self.handle.barrier(channel=channel)

    def streams(self) -> list[torch.cuda.Stream]:
        """Two side streams for pipelined reductions (created once)."""
        if not hasattr(self, "_streams"):
            self._streams = [torch.cuda.Stream(self.buffer.device) for _ in range(2)]
        return self._streams
