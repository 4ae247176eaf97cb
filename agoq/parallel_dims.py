"""The parallel layout as dimensions: how many ranks replicate, shard, pipeline (and, reserved, split tensors) one
run, as one validated value the search, the plan, `agoq train` and the dashboard share.

A run of N ranks is a grid

  N = replicate x shard x pipeline x tensor

  replicate  ranks that keep the whole model and optimizer state and all-reduce gradients (DDP; 1: one process)
  shard      ranks that keep 1/shard of the state each and reduce-scatter gradients; `engine` says what shards:
             "fsdp2" (PyTorch's FSDP2 with agoq's collectives: parameters, gradients and optimizer state 1/N per
             rank). "sdp4bit", agoq's own retired sharded step, is refused (agoq.vocabulary.SHARDED_RETIRED)
  pipeline   stages of consecutive decoder layers, one rank each (1F1B)
  tensor     reserved: tensor parallelism is refused for now

with `ranks_per_node` the ranks of a node for data parallelism (TLq-HS's two-level reduce-scatter reads it; a
replicated or FSDP2 plan keeps it as the nodes it was priced over, e.g. a what-if plan's --node-size; None:
torchrun's LOCAL_WORLD_SIZE). `engine` is set for a sharded state whatever the number of ranks: a sharded plan searched on a
one-rank profile has shard 1 and shards over the ranks it is launched on.

What runs today (the runtime's parallel modes, agoq.vocabulary.PARALLEL_MODES), and so what `ParallelDims`
accepts: one axis > 1, or replicate x shard with engine fsdp2 (HSDP: FSDP2 over a 2-D mesh, replicas across nodes
of the shards within a node; `ranks_per_node`, when given, is the shard dimension); pipeline stages are not
combined with data parallelism, and an engine only beside shard. Data ranks (ranks that read different batches,
what the tokens of a step count) are replicate x shard; a pipeline's stages read one batch.

Nothing heavy is imported: the search reads this module without torch (tests/test_lazy_import.py).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from agoq.vocabulary import (BF16, DDP, FSDP, HSDP, LAYOUTS, NONE, PARALLEL_MODES, PIPELINE, REPLICATED, SDP4BIT,
                             SHARDED, SHARDED_ENGINE, SHARDED_RETIRED)

FSDP2_ENGINE = "fsdp2"
ENGINES = (FSDP2_ENGINE,)  # what shards the state: PyTorch's FSDP2 (agoq's own sdp4bit engine was retired)
PLAN_ENGINES = (SHARDED_ENGINE, FSDP2_ENGINE)  # what a plan's parallel.engine may say: the retired one is refused
ENGINE_LAYOUT = {None: REPLICATED, FSDP2_ENGINE: FSDP}  # the search's layout word (replicas of FSDP2's: hsdp)
LAYOUT_ENGINE = {**{layout: engine for engine, layout in ENGINE_LAYOUT.items()}, HSDP: FSDP2_ENGINE}
MODE_ENGINE = {FSDP: FSDP2_ENGINE}  # the runtime's sharded modes


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"parallel.{name} must be a whole number >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """A run's ranks as dimensions (see the module docstring). Built only valid: ValueError naming the dimension
    and what to do otherwise. `validate(world_size)` checks it against the ranks a run has."""

    replicate: int = 1
    shard: int = 1
    pipeline: int = 1
    tensor: int = 1
    ranks_per_node: Optional[int] = None
    engine: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("replicate", "shard", "pipeline", "tensor"):
            _count(name, getattr(self, name))
        if self.tensor > 1:
            raise ValueError(f"parallel.tensor {self.tensor}: tensor parallelism is not supported yet; set tensor "
                             "to 1 (use replicate, shard or pipeline ranks)")
        if self.engine == SHARDED_ENGINE:
            raise ValueError(f"parallel.engine {self.engine}: {SHARDED_RETIRED}")
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"parallel.engine must be one of {', '.join(ENGINES)} (or none for a replicated "
                             f"state), got {self.engine!r}")
        if self.shard > 1 and self.engine is None:
            raise ValueError(f"parallel.shard {self.shard} needs an engine that shards the state: "
                             f"{FSDP2_ENGINE} (PyTorch's FSDP2)")
        if self.pipeline > 1 and (self.replicate > 1 or self.shard > 1 or self.engine is not None):
            raise ValueError(f"parallel.pipeline {self.pipeline} with data parallelism (replicate {self.replicate}, "
                             f"shard {self.shard}, engine {self.engine}): pipeline stages and data parallelism are "
                             "not combined; run one process per stage (replicate 1, shard 1, no engine)")
        if self.ranks_per_node is not None:
            _count("ranks_per_node", self.ranks_per_node)
            if self.pipeline > 1:
                raise ValueError("parallel.ranks_per_node is for data-parallel ranks (the nodes their collectives "
                                 "cross): drop it for pipeline stages")
            if self.hybrid and self.ranks_per_node != self.shard:
                raise ValueError(f"parallel.ranks_per_node {self.ranks_per_node} with replicate {self.replicate} x "
                                 f"shard {self.shard} (HSDP): HSDP shards within a node and replicates across "
                                 f"nodes, so a node holds the {self.shard} shard ranks: give ranks_per_node "
                                 f"{self.shard} (or leave it out)")

    # ------------------------------------------------------------------------------------------ constructors

    @classmethod
    def of_layout(cls, layout: str, world_size: int, stages: int = 1,
                  ranks_per_node: Optional[int] = None) -> "ParallelDims":
        """The dims of a plan the search prices in `layout` (agoq.vocabulary.LAYOUTS) over `world_size` ranks with
        `stages` pipeline stages: a pipeline of `stages` ranks (replicated stages), else hsdp's replicas of the
        shards of a node of `ranks_per_node` (`hybrid_of`), else the layout's engine over all ranks (shard = world
        size), else replicas (replicate = world size)."""
        if layout == SHARDED:
            raise ValueError(SHARDED_RETIRED)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        _count("world_size", world_size)
        if _count("pipeline", stages) > 1:
            if layout != REPLICATED:
                raise ValueError(f"layout {layout} with {stages} pipeline stages: pipeline stages keep a replicated "
                                 "state (one process per stage); search the pipeline with layout replicated")
            return cls(pipeline=stages)
        if layout == HSDP:
            return cls.hybrid_of(world_size, ranks_per_node)
        engine = LAYOUT_ENGINE[layout]
        if engine is None:
            return cls(replicate=world_size)
        return cls(shard=world_size, engine=engine, ranks_per_node=ranks_per_node)

    @classmethod
    def of_mode(cls, mode: str, world_size: int, pipeline_stages: Optional[int] = None,
                ranks_per_node: Optional[int] = None) -> "ParallelDims":
        """The dims of a run in the runtime's parallel mode `mode` (agoq.vocabulary.PARALLEL_MODES) over
        `world_size` ranks: none and ddp replicate, fsdp shards (FSDP2), hsdp replicates
        nodes of `ranks_per_node` FSDP2 shards (world / ranks_per_node replicas, at least 2), a pipeline has
        `pipeline_stages` (None: one per rank)."""
        if mode == SHARDED:
            raise ValueError(SHARDED_RETIRED)
        if mode not in PARALLEL_MODES:
            raise ValueError(f"parallel mode must be one of {', '.join(PARALLEL_MODES)}, got {mode!r}")
        _count("world_size", world_size)
        if mode == PIPELINE:
            return cls(pipeline=pipeline_stages or world_size)
        if mode == HSDP:
            return cls.hybrid_of(world_size, ranks_per_node)
        if mode in MODE_ENGINE:
            return cls(shard=world_size, engine=MODE_ENGINE[mode], ranks_per_node=ranks_per_node)
        return cls(replicate=world_size, ranks_per_node=ranks_per_node)

    @classmethod
    def hybrid_of(cls, world_size: int, node_size: Optional[int]) -> "ParallelDims":
        """HSDP's dims over `world_size` ranks in nodes of `node_size`: replicate world / node x shard node, FSDP2.
        ValueError (the command line's words) when the node size is missing, does not divide the world, or holds
        the whole world (that is fsdp)."""
        if node_size is None:
            raise ValueError("--parallel hsdp shards within a node and replicates across nodes: give the ranks of "
                             "a node with --node-size (torchrun's LOCAL_WORLD_SIZE is used when it is set)")
        _count("ranks_per_node", node_size)
        if world_size % node_size:
            raise ValueError(f"--parallel hsdp: --node-size {node_size} does not divide the world's {world_size} "
                             "ranks: give the ranks of one node (all nodes alike)")
        if node_size == world_size:
            raise ValueError(f"--parallel hsdp with one node of {world_size} ranks has no replicas: that is "
                             f"--parallel fsdp; or give a smaller --node-size to replicate across nodes")
        return cls(replicate=world_size // node_size, shard=node_size, engine=FSDP2_ENGINE, ranks_per_node=node_size)

    @classmethod
    def of_launch(cls, launch: Mapping[str, Any]) -> "ParallelDims":
        """The dims of a plan's `launch` (plans before 1.8: {processes, parallel, command}): its parallel mode
        over its processes (hsdp's node size read off its command's --node-size)."""
        mode = launch.get("parallel")
        processes = launch.get("processes")
        processes = 1 if processes is None else processes
        node = re.search(r"--node-size (\d+)", str(launch.get("command") or "")) if mode == HSDP else None
        try:
            return cls.of_mode(mode, _count("processes", processes), ranks_per_node=int(node[1]) if node else None)
        except ValueError as e:
            raise ValueError(f"launch: {e}") from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParallelDims":
        """The dims of a plan's `parallel` section (its JSON data; fields left out take their defaults)."""
        known = {k: data[k] for k in ("replicate", "shard", "pipeline", "tensor", "ranks_per_node", "engine")
                 if k in data}
        return cls(**known)

    # ------------------------------------------------------------------------------------------ reading

    @property
    def world_size(self) -> int:
        """Ranks of the grid: replicate x shard x pipeline x tensor."""
        return self.replicate * self.shard * self.pipeline * self.tensor

    @property
    def data_ranks(self) -> int:
        """Ranks that read different batches: replicate x shard (a pipeline's stages read one)."""
        return self.replicate * self.shard

    @property
    def sharded(self) -> bool:
        """The optimizer state (and FSDP2's parameters) is 1/shard per rank."""
        return self.engine is not None

    @property
    def hybrid(self) -> bool:
        """Replicas of shards (HSDP): replicate > 1 with FSDP2's sharded state."""
        return self.engine == FSDP2_ENGINE and self.replicate > 1

    @property
    def layout(self) -> str:
        """The search's layout word: replicated, fsdp (FSDP2) or hsdp (FSDP2's replicas across nodes)."""
        return HSDP if self.hybrid else ENGINE_LAYOUT[self.engine]

    @property
    def mode(self) -> str:
        """The runtime's parallel mode (`agoq train --parallel`): pipeline for several stages, fsdp for FSDP2 (hsdp
        with replicas), else ddp for several ranks and none for one."""
        if self.pipeline > 1:
            return PIPELINE
        if self.hybrid:
            return HSDP
        if self.engine == FSDP2_ENGINE:
            return FSDP
        return DDP if self.world_size > 1 else NONE

    @property
    def fixes_world(self) -> bool:
        """Whether a run of these dims needs exactly their ranks: a pipeline (one rank per stage) and a sharded
        state (1/N per rank, priced for N) do; replicas run in any number of processes."""
        return self.pipeline > 1 or self.sharded

    def validate(self, world_size: int) -> "ParallelDims":
        """These dims, when their grid is `world_size` ranks; else ValueError saying both."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"a world has at least one rank, got {world_size!r}")
        if self.world_size != world_size:
            raise ValueError(f"parallel: replicate {self.replicate} x shard {self.shard} x pipeline {self.pipeline} "
                             f"x tensor {self.tensor} is {self.world_size} rank(s), the world has {world_size}: give "
                             f"dimensions whose product is {world_size}")
        if self.ranks_per_node is not None and world_size % self.ranks_per_node:
            raise ValueError(f"parallel.ranks_per_node {self.ranks_per_node} does not divide the world's "
                             f"{world_size} ranks: give the ranks of one node (all nodes alike)")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The dims as a plan's `parallel` section."""
        return asdict(self)

    def describe(self) -> str:
        """The dims in words, e.g. "shard 4 (sdp4bit)", "pipeline 2", "replicate 1"."""
        parts = [f"{name} {getattr(self, name)}" for name in ("replicate", "shard", "pipeline", "tensor")
                 if getattr(self, name) > 1]
        text = ", ".join(parts) or "one rank"
        return f"{text} ({self.engine})" if self.engine else text


def launch_line(mode: str, processes: int | str, gradients: Optional[str] = None,
                weight_gather: Optional[str] = None, node_size: Optional[int] = None) -> str:
    """The command that launches a plan in `mode` over `processes` (MODEL and PLAN.json are placeholders): torchrun
    for several processes, with `--gradients sdp4bit` where fsdp is to reduce-scatter by TLq-HS, `--weight-gather W`
    where FSDP2 gathers its weights as W block codes (int8, int4; None or bf16: its own), and hsdp's `--node-size`
    (and its quantized gradients)."""
    if mode == SHARDED:
        raise ValueError(SHARDED_RETIRED)
    if processes == 1:
        command = "agoq train MODEL --plan PLAN.json"
    else:
        command = f"torchrun --nproc-per-node {processes} -m agoq.train MODEL --plan PLAN.json --parallel {mode}"
    if mode == HSDP:
        command += f" --node-size {node_size or 'N'}"
    if (mode == FSDP and gradients == SDP4BIT) or (mode == HSDP and gradients not in (None, BF16)):
        command += f" --gradients {gradients}"
    if mode in (FSDP, HSDP) and weight_gather not in (None, "bf16"):
        command += f" --weight-gather {weight_gather}"
    return command


def launch_of(dims: ParallelDims, gradients: Optional[str] = None, weight_gather: Optional[str] = None) -> dict[str, Any]:
    """A plan's `launch` as derived from its dims (what the user runs): processes, parallel mode, command."""
    return {"processes": dims.world_size, "parallel": dims.mode,
            "command": launch_line(dims.mode, dims.world_size, gradients, weight_gather,
                                   dims.shard if dims.hybrid else None)}


def plan_dims(plan: Mapping[str, Any]) -> Optional[ParallelDims]:
    """The dims of a plan's JSON data: its `parallel` section (1.8), else its `launch` (before), else None (1.0
    plans say nothing of their layout)."""
    parallel, launch = plan.get("parallel"), plan.get("launch")
    if isinstance(parallel, Mapping):
        return ParallelDims.from_dict(parallel)
    if isinstance(launch, Mapping) and launch.get("parallel"):
        return ParallelDims.of_launch(launch)
    return None


__all__ = ["ParallelDims", "ENGINES", "PLAN_ENGINES", "FSDP2_ENGINE", "ENGINE_LAYOUT", "LAYOUT_ENGINE",
           "MODE_ENGINE", "launch_line", "launch_of", "plan_dims"]
