"""A latency-bandwidth (alpha-beta) model of the collectives agoq prices, per operation and path, composed over a
cluster of nodes, fitted to a profile's measured collectives or given as links (`--network`).

Links. A link moves B bytes in alpha + B / beta seconds (alpha: latency, seconds; beta: bytes per second of one
rank's share of the link). A cluster of N ranks is M = N / G nodes of G ranks; ranks of one node talk over the
`intra` link, ranks of different nodes over the `inter` link (beta: one GPU's share of its node's network, e.g.
one 400 Gb/s NIC per GPU: 50 GB/s).

One level, P ranks on one link, a tensor of B bytes on the wire (Hockney's terms, as NCCL's ring and tree run):

  ring reduce-scatter, ring all-gather  (P - 1) alpha + (P - 1) / P x B / beta
  ring all-reduce                       2 (P - 1) alpha + 2 (P - 1) / P x B / beta
  tree all-reduce                       2 ceil(log2 P) alpha + 2 B / beta   (a double binary tree: reduce up, then
                                        broadcast down, pipelined; NCCL takes the faster of ring and tree)
  all-to-all (pairwise)                 (P - 1) alpha + (P - 1) / P x B / beta

Two levels (NCCL's rings run one channel per GPU and cross nodes once per node, as two-level collectives do; a
level of one rank costs nothing):

  reduce-scatter   RS(intra, G, B) + RS(inter, M, B / G)
  all-gather       AG(inter, M, B / G) + AG(intra, G, B)
  all-reduce       RS(intra, G, B) + AR(inter, M, B / G) + AG(intra, G, B)
  all-to-all       intra and inter parts at once: max((G - 1) alpha_i + (G - 1) / N x B / beta_i,
                                                      (N - G) alpha_e + (N - G) / N x B / beta_e)

Paths (`message_bytes`: the float32 bytes of the whole tensor, 4 per value, as the profile's table; n values):

  nccl-fp32, nccl-bf16   4 or 2 bytes per value on the wire; all_reduce, reduce_scatter, all_gather two-level
  quangrad8              agoq's 8-bit all-reduce (agoq.runtime.comm.quantized_allreduce): an all-to-all of int8
                         codes + one float32 scale per 256 values (1 + 4/256 bytes per value), then an all-gather of
                         the requantized sums (same bytes)
  sdp4bit reduce_scatter TLq-HS (agoq.runtime.comm.sdp4bit): int8 + a float32 scale per 128 values all-to-all inside
                         the node over the whole tensor, then int4 + a scale per 128 all-to-all across nodes over the
                         node's 1/G of it
  sdp4bit all_gather     qWD: int4 weight differences + a float32 scale per 2048 values, all-gathered
  int8-weights all_gather agoq's FSDP2 weight all-gather in int8 (ZeRO++'s qwZ; agoq.runtime.comm.fsdp_weight_gather):
                         1 + 4/256 bytes per value
  int4-weights all_gather the same in int4 after Hadamard-32: 0.5 + 4/256 bytes per value
  tlq4 all_reduce        HSDP's 4-bit all-reduce of the replicas (agoq.runtime.comm.hsdp.tlq_all_reduce): an
                         all-to-all of int4 codes + a float32 scale per 128 values (0.5 + 4/128 bytes per value), then
                         an all-gather of the requantized sums (same bytes)

A quantized path also quantizes and dequantizes: `Kernel` seconds per value (and fixed seconds), fitted from the
profile's own timings of that path: its measured collectives' residual beyond the wire, else its kernels timed in
one process (profile.json collective_kernels; 0 where the profile has neither). Both were run on one node, so TLq-HS's
kernel K8 is its int8 level's (Hadamard-32, int8 codes of the whole tensor, dequantize and sum, inverse Hadamard);
its int4 level across nodes is timed on its own, INT4_LEVEL = (reduce_scatter, sdp4bit-int4-level), as K4 over the
values it touches. TLq-HS's reduce-scatter of n = message_bytes / 4 values on N ranks in nodes of G costs, in seconds,

  wire + K8(n) + K4(n / G)     where the ranks span nodes of more than one rank (1 < G < N)
  wire + K8(n)                 one node (G = N: no int4 level), or one rank per node (G = 1: no int8 level, and the
                               int4 level quantizes the same n values once, which K8 prices)

K(n) = fixed + per_value x n; K4(n / G) is Kernel.seconds(message_bytes / G). Where the kernels have no K4 (a profile
of collective_kernels version 1, kernels fitted to measured collectives) nothing is added (agoq.search.whatif's notes
say so). The wire formats here are the runtime's (tests check the constants against it); this module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from agoq.formats.collective_kernels import INT4_LEVEL

# bytes per value on the wire, per (path, part); see the module docstring
GRADIENT_GROUP, WEIGHT_BLOCK, ALLREDUCE_BLOCK, WEIGHT_GATHER_BLOCK = 128, 2048, 256, 256
WIRE_BYTES = {
    "nccl-fp32": 4.0,
    "nccl-bf16": 2.0,
    "quangrad8": 1.0 + 4.0 / ALLREDUCE_BLOCK,
    "sdp4bit-intra": 1.0 + 4.0 / GRADIENT_GROUP,      # TLq-HS's int8 level
    "sdp4bit-inter": 0.5 + 4.0 / GRADIENT_GROUP,      # TLq-HS's int4 level
    "sdp4bit-weights": 0.5 + 4.0 / WEIGHT_BLOCK,      # qWD
    "int8-weights": 1.0 + 4.0 / WEIGHT_GATHER_BLOCK,
    "int4-weights": 0.5 + 4.0 / WEIGHT_GATHER_BLOCK,
    "tlq4": 0.5 + 4.0 / GRADIENT_GROUP,               # HSDP's 4-bit all-reduce across nodes
}
NCCL_PATHS = ("nccl-fp32", "nccl-bf16")
OPERATIONS = {  # (op, path) this model prices
    ("all_reduce", "nccl-fp32"), ("reduce_scatter", "nccl-fp32"), ("all_gather", "nccl-fp32"),
    ("all_reduce", "nccl-bf16"), ("reduce_scatter", "nccl-bf16"), ("all_gather", "nccl-bf16"),
    ("all_reduce", "quangrad8"), ("reduce_scatter", "sdp4bit"), ("all_gather", "sdp4bit"),
    ("all_gather", "int8-weights"), ("all_gather", "int4-weights"), ("all_reduce", "tlq4"),
}


@dataclass(frozen=True)
class Link:
    """One link: `bandwidth` bytes per second (one rank's share), `latency` seconds per message step."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"a link's bandwidth must be a finite number of bytes/s > 0, got {self.bandwidth!r}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"a link's latency must be a finite number of seconds >= 0, got {self.latency!r}")

    def seconds(self, steps: float, nbytes: float) -> float:
        """steps x latency + nbytes / bandwidth."""
        return steps * self.latency + nbytes / self.bandwidth

    def describe(self) -> str:
        return f"{self.bandwidth / 1e9:.4g} GB/s @ {self.latency * 1e6:.3g} us"


# ------------------------------------------------------------------------------------ one level, P ranks


def ring_reduce_scatter(link: Link, ranks: int, nbytes: float) -> float:
    """(P - 1) alpha + (P - 1) / P x B / beta; 0 for one rank."""
    return 0.0 if ranks <= 1 else link.seconds(ranks - 1, (ranks - 1) / ranks * nbytes)


ring_all_gather = ring_reduce_scatter  # the same steps and bytes, in the other direction


def ring_all_reduce(link: Link, ranks: int, nbytes: float) -> float:
    """2 (P - 1) alpha + 2 (P - 1) / P x B / beta."""
    return 0.0 if ranks <= 1 else link.seconds(2 * (ranks - 1), 2 * (ranks - 1) / ranks * nbytes)


def tree_all_reduce(link: Link, ranks: int, nbytes: float) -> float:
    """2 ceil(log2 P) alpha + 2 B / beta (reduce up a tree, broadcast down, pipelined)."""
    return 0.0 if ranks <= 1 else link.seconds(2 * math.ceil(math.log2(ranks)), 2 * nbytes)


def all_reduce_one_level(link: Link, ranks: int, nbytes: float) -> float:
    """The faster of ring and tree, as NCCL's tuner picks."""
    return min(ring_all_reduce(link, ranks, nbytes), tree_all_reduce(link, ranks, nbytes))


def all_to_all(link: Link, ranks: int, nbytes: float) -> float:
    """(P - 1) alpha + (P - 1) / P x B / beta: each rank sends B / P to each other rank, pairwise."""
    return 0.0 if ranks <= 1 else link.seconds(ranks - 1, (ranks - 1) / ranks * nbytes)


# ------------------------------------------------------------------------------------ two levels


@dataclass(frozen=True)
class Cluster:
    """N = `world` ranks in nodes of `node_size` ranks over `intra` and `inter` links."""

    world: int
    node_size: int
    intra: Link
    inter: Link

    def __post_init__(self):
        for name in ("world", "node_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
        if self.world % self.node_size:
            raise ValueError(f"the world of {self.world} ranks is not a whole number of nodes of {self.node_size}: "
                             "give a world size that is a multiple of the node size")

    @property
    def nodes(self) -> int:
        return self.world // self.node_size


def reduce_scatter(c: Cluster, nbytes: float) -> float:
    """RS(intra, G, B) + RS(inter, M, B / G)."""
    return ring_reduce_scatter(c.intra, c.node_size, nbytes) + ring_reduce_scatter(c.inter, c.nodes,
                                                                                   nbytes / c.node_size)


def all_gather(c: Cluster, nbytes: float) -> float:
    """AG(inter, M, B / G) + AG(intra, G, B)."""
    return ring_all_gather(c.inter, c.nodes, nbytes / c.node_size) + ring_all_gather(c.intra, c.node_size, nbytes)


def all_reduce(c: Cluster, nbytes: float) -> float:
    """One node or one rank per node: that level's faster of ring and tree; else RS(intra) + AR(inter, B / G) +
    AG(intra)."""
    if c.nodes == 1:
        return all_reduce_one_level(c.intra, c.world, nbytes)
    if c.node_size == 1:
        return all_reduce_one_level(c.inter, c.world, nbytes)
    return ring_reduce_scatter(c.intra, c.node_size, nbytes) \
        + all_reduce_one_level(c.inter, c.nodes, nbytes / c.node_size) \
        + ring_all_gather(c.intra, c.node_size, nbytes)


def flat_all_to_all(c: Cluster, nbytes: float) -> float:
    """All N ranks exchange B / N each: intra and inter peers at once, the slower sets the time."""
    n, g = c.world, c.node_size
    inside = c.intra.seconds(g - 1, (g - 1) / n * nbytes) if g > 1 else 0.0
    across = c.inter.seconds(n - g, (n - g) / n * nbytes) if n > g else 0.0
    return max(inside, across)


def wire_seconds(op: str, path: str, message_bytes: float, c: Cluster) -> float:
    """Seconds on the links of `op` on `path` for a tensor of `message_bytes` float32 bytes (kernels not counted)."""
    values = message_bytes / 4.0
    if path in NCCL_PATHS:
        nbytes = values * WIRE_BYTES[path]
        return {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather}[op](c, nbytes)
    if op == "all_reduce" and path in ("quangrad8", "tlq4"):
        nbytes = values * WIRE_BYTES[path]
        return flat_all_to_all(c, nbytes) + all_gather(c, nbytes)
    if (op, path) == ("reduce_scatter", "sdp4bit"):
        return all_to_all(c.intra, c.node_size, values * WIRE_BYTES["sdp4bit-intra"]) \
            + all_to_all(c.inter, c.nodes, values / c.node_size * WIRE_BYTES["sdp4bit-inter"])
    if (op, path) == ("all_gather", "sdp4bit"):
        return all_gather(c, values * WIRE_BYTES["sdp4bit-weights"])
    if op == "all_gather" and path in ("int8-weights", "int4-weights"):
        return all_gather(c, values * WIRE_BYTES[path])
    raise ValueError(f"no network model of {op} on {path} (known: "
                     f"{', '.join(sorted(f'{o} {p}' for o, p in OPERATIONS))})")


@dataclass(frozen=True)
class Kernel:
    """A quantized path's own compute: `fixed` seconds + `per_value` seconds per value of the tensor."""

    fixed: float = 0.0
    per_value: float = 0.0

    def seconds(self, message_bytes: float) -> float:
        return self.fixed + self.per_value * message_bytes / 4.0


@dataclass(frozen=True)
class Network:
    """The links of a cluster and where they come from: `source` (a preset's published figures, the fit to a
    profile, or the user's --network), `kernels` the quantized paths' compute by (op, path)."""

    intra: Link
    inter: Link
    name: str
    source: str
    kernels: dict = field(default_factory=dict)

    def cluster(self, world: int, node_size: int) -> Cluster:
        return Cluster(world, node_size, self.intra, self.inter)

    def seconds(self, op: str, path: str, message_bytes: float, world: int, node_size: int) -> float:
        """Seconds of `op` on `path` for `message_bytes` float32 bytes on `world` ranks in nodes of `node_size`:
        the wire's time plus the path's kernels (`kernel_parts`; none for one rank: nothing is sent or quantized)."""
        if world <= 1:
            return 0.0
        kernels = sum((s for _, s in self.kernel_parts(op, path, message_bytes, world, node_size)), 0.0)
        return wire_seconds(op, path, message_bytes, self.cluster(world, node_size)) + kernels

    def kernel_parts(self, op: str, path: str, message_bytes: float, world: int, node_size: int) -> list:
        """[((op, path) of `kernels`, seconds)]: the kernels `op` on `path` runs for `message_bytes` float32 bytes on
        `world` ranks in nodes of `node_size` (G): its own Kernel at message_bytes where `kernels` has it; for TLq-HS's
        reduce-scatter (reduce_scatter, sdp4bit) over ranks spanning nodes of more than one rank (1 < G < N), also
        its int4 level's, kernels[INT4_LEVEL].seconds(message_bytes / G) (the node's 1/G of the values), where
        `kernels` has it (the module docstring's formula). [] for one rank."""
        if world <= 1:
            return []
        parts = [((op, path), self.kernels[(op, path)].seconds(message_bytes))] if (op, path) in self.kernels else []
        if (op, path) == ("reduce_scatter", "sdp4bit") and 1 < node_size < world and INT4_LEVEL in self.kernels:
            parts.append((INT4_LEVEL, self.kernels[INT4_LEVEL].seconds(message_bytes / node_size)))
        return parts

    def with_kernels(self, kernels: dict) -> "Network":
        return replace(self, kernels=dict(kernels))

    def describe(self) -> str:
        return f"{self.name}: intra {self.intra.describe()}, inter {self.inter.describe()} ({self.source})"


__all__ = ["Link", "Cluster", "Kernel", "Network", "INT4_LEVEL", "WIRE_BYTES", "OPERATIONS", "NCCL_PATHS",
           "wire_seconds", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "tree_all_reduce", "all_to_all",
           "all_reduce", "reduce_scatter", "all_gather", "flat_all_to_all"]
