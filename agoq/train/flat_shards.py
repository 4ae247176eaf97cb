"""Unevenly sharded flat tensors in torch.distributed.checkpoint (DCP): each rank saves and loads its own piece.

DCP reshards DTensors (pieces as torch.chunk cuts them) and plain tensors (whole on every rank). A state kept
in pieces of any lengths, such as SDP4Bit's shards of the flat parameters (whole 128-value groups, sizes
differing by one group), is neither. `FlatShard(local, offset, numel)` says: `local` holds elements
[offset, offset + local.numel()) of a 1-D logical tensor of `numel` elements. Put it in the state dict in
place of a tensor and save / load with `FlatShardSavePlanner` / `FlatShardLoadPlanner`: the checkpoint's
metadata then records the logical tensor and each rank's chunk, and a later load reads, for whatever piece
the loading rank holds, the overlapping parts of the saved chunks. The logical tensor is the same whatever
the world size, so a checkpoint of N pieces loads into M. A rank with an empty piece writes and reads nothing.

`FlatShard` follows the chunk protocol DCP's planner helpers ask tensor-like objects for
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`, as DTensor does); the planners
add the lookups DCP's default ones make only for torch.Tensor values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass
class FlatShard:
    """`local` (1-D, contiguous) = elements [offset, offset + local.numel()) of a 1-D logical tensor of `numel`
    elements (offset and numel in elements). Loading writes into `local` in place."""

    local: torch.Tensor
    offset: int
    numel: int

    def __post_init__(self) -> None:
        if self.local.dim() != 1 or not self.local.is_contiguous():
            raise ValueError(f"a FlatShard holds a contiguous 1-D tensor, got shape {tuple(self.local.shape)}")
        if not 0 <= self.offset <= self.offset + self.local.numel() <= self.numel:
            raise ValueError(f"a piece of {self.local.numel()} elements at offset {self.offset} does not fit in a "
                             f"logical tensor of {self.numel}")

    def size(self) -> torch.Size:
        """The logical tensor's size (what DCP compares with the saved one)."""
        return torch.Size([self.numel])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        if self.local.numel() == 0:
            return []
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([self.offset])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.size()))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.local.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and tuple(index.offset) != (self.offset,):
            raise ValueError(f"{index.fqn}: this rank holds the piece at offset {self.offset}, not {index.offset}")
        return self.local


class FlatShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also writes `FlatShard` values as their rank's chunk."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatShard):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


def _shard_paths(tree, path=()) -> list[tuple[tuple, FlatShard]]:
    """(path, FlatShard) of every FlatShard in a nested state dict (dicts and lists)."""
    if isinstance(tree, FlatShard):
        return [(path, tree)]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return [found for k, v in items for found in _shard_paths(v, path + (k,))]


def _put(tree, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


class FlatShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also reads `FlatShard` values: the parts of the saved chunks that overlap
    this rank's piece, into it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up rewrites the state dict's leaves it does not know (to None): hand it the pieces' tensors,
        # then put the FlatShards back, in the nested dict and in the flattened one the plan is made from
        shards = _shard_paths(state_dict)
        for path, shard in shards:
            _put(state_dict, path, shard.local)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        by_path = {tuple(str(k) for k in path): shard for path, shard in shards}
        for path, shard in shards:
            _put(state_dict, path, shard)
        for key in list(self.state_dict):
            path = self.mappings.get(key, (key,)) if self.flatten_state_dict else (key,)
            shard = by_path.get(tuple(str(k) for k in path))
            if shard is not None:
                self.state_dict[key] = shard

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatShard):
            return obj.local
        return super().lookup_tensor(index)


__all__ = ["FlatShard", "FlatShardSavePlanner", "FlatShardLoadPlanner"]
