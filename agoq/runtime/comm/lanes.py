"""Spreading one exchange over several communicators ("lanes") of the same ranks.

Over NCCL's socket transport an all-to-all runs on few connections and proxy threads, and carries
fewer bytes per second than a ring collective does. Cutting the payload into column chunks and
moving each chunk on its own communicator, all at once, puts more connections to work. `lanes(group,
k)` creates the k - 1 extra communicators on first use (only the group's members take part, so any
subgroup works); the results are the same bytes whatever k is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_LANES: dict[tuple, list] = {}


def lanes(group, count: int) -> list:
    """`group` followed by count - 1 more communicators of the same ranks (created once, collectively)."""
    if count < 1:
        raise ValueError(f"lanes: count must be >= 1, got {count}")
    if count == 1:
        return [group]
    world_group = dist.group.WORLD
    key = (id(world_group), id(group) if group is not None else None, count)
    if key not in _LANES:
        ranks = dist.get_process_group_ranks(group if group is not None else world_group)
        _LANES[key] = [group] + [dist.new_group(ranks, use_local_synchronization=True) for _ in range(count - 1)]
    return _LANES[key]


def _edges(width: int, count: int) -> list[tuple[int, int]]:
    return [(width * i // count, width * (i + 1) // count) for i in range(count)]


def all_to_all(x: torch.Tensor, groups: list) -> torch.Tensor:
    """All-to-all of the rows of x [W, B] (row j goes to rank j), each row's columns split over the lanes."""
    out = torch.empty_like(x)
    if len(groups) == 1:
        dist.all_to_all_single(out, x, group=groups[0])
        return out
    x2 = x.view(x.shape[0], -1)
    o2 = out.view(x.shape[0], -1)
    pieces, works = [], []
    for g, (a, b) in zip(groups, _edges(x2.shape[1], len(groups))):
        send = x2[:, a:b].contiguous()
        recv = torch.empty_like(send)
        works.append(dist.all_to_all_single(recv, send, group=g, async_op=True))
        pieces.append((a, b, recv))
    for w in works:
        w.wait()
    for a, b, recv in pieces:
        o2[:, a:b].copy_(recv)
    return out


def all_gather(x: torch.Tensor, groups: list, world: int) -> torch.Tensor:
    """[world, *x.shape]: every rank's `x` (equal shapes), in rank order, columns split over the lanes."""
    out = x.new_empty((world,) + tuple(x.shape))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # name differs by version
    flat = x.contiguous().view(-1)
    if len(groups) == 1:
        gather(out.view(-1), flat, group=groups[0])
        return out
    o2 = out.view(world, -1)
    pieces, works = [], []
    for g, (a, b) in zip(groups, _edges(flat.numel(), len(groups))):
        recv = flat.new_empty(world * (b - a))
        works.append(gather(recv, flat[a:b].contiguous(), group=g, async_op=True))
        pieces.append((a, b, recv))
    for w in works:
        w.wait()
    for a, b, recv in pieces:
        o2[:, a:b].copy_(recv.view(world, b - a))
    return out
