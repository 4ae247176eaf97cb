"""The data-parallel layout of a plan over the profile's ranks, and what FSDP2 costs per rank.

Layouts (world size N = the profile's `settings.world_size`):

  replicated  every rank keeps the whole model (DDP; one process when N = 1); gradients bf16 or quangrad8,
              all-reduced once per step (agoq.search.costs)
  fsdp        PyTorch's FSDP2 (`agoq train --parallel fsdp`), one unit per decoder layer and one root unit
              (embeddings, final norm, LM head); gradients reduce-scattered in bf16 (gradient mode bf16) or by
              SDP4Bit's TLq-HS (gradient mode sdp4bit, `--gradients sdp4bit`), whose weights FSDP2 then may
              gather as agoq's int8 or int4 block codes (`--weight-gather`, priced by their wire bytes)
  hsdp        FSDP2 over replicate R x shard S (`agoq train --parallel hsdp --node-size S`): sharded within a node
              of S ranks as fsdp is over all, the node's shard of each unit's gradients then all-reduced across the
              R nodes; offered only where the ranks span nodes, 1 < S < N (a what-if's --node-size), priced in
              agoq.search.hsdp

agoq's own ZeRO-style SDP4Bit step (layout "sharded") was retired: FSDP2 with TLq-HS and the int4 weight gather
replaced it (agoq.vocabulary.SHARDED_RETIRED); a plan of sdp4bit gradients is an fsdp plan.

FSDP2 memory per rank, bytes (W, G, M, A: the whole model's bf16 weights, bf16 gradients, float32 masters and
optimizer moments, agoq.search.state.state_parts; e: bytes per bf16 value, 2; n_root, n_layer: values of the root
unit and of one decoder layer):

  sharded   = (W + G + M + A) / N                            (agoq.search.state.state_per_rank)
              (the runtime's shards are float32 parameters = the masters and float32 gradients, 4 + 4 bytes per
              value with masters, or bf16 parameters and gradients, 2 + 2, without: the same totals)
  in flight = e x (n_root + IN_FLIGHT_LAYERS x n_layer)      all-gathered bf16 weights: the root unit, whose
                                                             forward spans the step, the layer computing and the
                                                             one prefetched
            + g x max(n_root, n_layer)                      one unit's unsharded gradients before their
                                                             reduce-scatter (g = 2 for bf16, 4 for TLq-HS, which
                                                             reduces from float32)

The activations, the LM head's tensors and the calibrated workspace come on top as for any plan
(agoq.search.costs); at the optimizer step nothing is unsharded: its floor is the sharded state + the profile's
optimizer-step fixed bytes and transient, as for the other layouts.

FSDP2 time per step, seconds: the compute of the step (grad_accum x fb(micro-batch), fb the bf16 fwd + bwd of one
micro-batch; the optimizer step over 1/N of the state: its measured seconds / N) plus the communication FSDP2 does
not hide. Every micro-batch all-gathers each unit's bf16 weights in forward and again in backward and
reduce-scatters its gradients (FSDP2 reduces every micro-batch). With ag(n), rs(n) the measured all-gather
(nccl-bf16) and reduce-scatter (nccl-bf16, or sdp4bit for TLq-HS) of a message of 4 x n bytes
(agoq.search.collective_times), L decoder layers and a layer's compute taken as fb / L, a third of it forward:

  exposed per micro-batch = L x max(0, ag(n_layer) - fb / (3 L))                 forward: the next layer's
                                                                                 all-gather runs under this
                                                                                 layer's forward
                          + L x max(0, ag(n_layer) + rs(n_layer) - 2 fb / (3 L)) backward: the next layer's
                                                                                 all-gather and the previous
                                                                                 one's reduce-scatter run under
                                                                                 this layer's backward
                          + 2 ag(n_root) + rs(n_root)                            the root unit's, not hidden

Where the table gives a collective's own kernels (k: a quantized path's quantize / Hadamard / dequantize, timed in
one process for a what-if; agoq.search.collective_times.kernel_seconds) they are taken out of what may hide and
added whole: ag - k_ag in the max terms, + k_ag (forward) + k_ag + k_rs (backward) per layer. Those kernels run on
the SMs the layers' compute needs; the wire's time is what NCCL overlaps. (A multi-rank profile's measured table
has no kernel part: its kernels hide with the rest, and its layout step calibrates what did not.)

  step = grad_accum x (fb + exposed per micro-batch) + optimizer seconds / N
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from agoq.search.collective_times import WORLD, collective_seconds, has_collective, kernel_seconds
from agoq.vocabulary import (  # the layouts, the gradient storage each is priced with
    FSDP,
    HSDP,
    LAYOUT_GRADIENTS,
    LAYOUTS,
    REPLICATED,
    SDP4BIT,
    SHARDED,
    SHARDED_RETIRED,
)

FSDP_REDUCE_PATHS = {"bf16": "nccl-bf16", "sdp4bit": "sdp4bit"}  # reduce-scatter path per gradient mode
FSDP_GATHER_PATH = "nccl-bf16"
# bytes per value FSDP2's weight all-gather sends (`agoq train --weight-gather`; agoq.runtime.comm.fsdp_weight_gather:
# bits / 8 + 4 / 256, a float32 scale per 256 values). A quantized gather is read off its own path of the table where
# the table has it (GATHER_PATHS: a what-if's modelled table, agoq.search.whatif, prices agoq's int8 gather by the
# network model, its kernels included), else timed as the bf16 path's collective of as many bytes
GATHER_BYTES = {"bf16": 2.0, "int8": 1.0 + 4.0 / 256, "int4": 0.5 + 4.0 / 256}
GATHER_PATHS = {"int8": "int8-weights", "int4": "int4-weights"}  # the collectives table's path of a quantized gather
IN_FLIGHT_LAYERS = 2  # decoder layers whose bf16 weights are unsharded at once: the one computing and the prefetched
# bytes per value of the unsharded gradients a reduce-scatter reads (quangrad8: hsdp's, FSDP2's exact one from float32)
REDUCE_BYTES = {"bf16": 2, "quangrad8": 4, "sdp4bit": 4}


def default_layout(gradient_mode: str) -> str:
    """The layout a plan without one means: sdp4bit gradients are FSDP2's with TLq-HS, the others replicated."""
    return FSDP if gradient_mode == SDP4BIT else REPLICATED


def resolve_layout(layout: Optional[str], gradient_mode: str) -> str:
    """`layout` (None: `default_layout`), checked against the gradient mode; raises ValueError (the retired
    sharded layout with what to run instead)."""
    layout = layout or default_layout(gradient_mode)
    if layout == SHARDED:
        raise ValueError(SHARDED_RETIRED)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if gradient_mode not in LAYOUT_GRADIENTS[layout]:
        raise ValueError(f"layout {layout} runs gradient mode(s) {', '.join(LAYOUT_GRADIENTS[layout])}, "
                         f"not {gradient_mode}")
    return layout


def fsdp_missing(table, gradient_mode: str) -> list[str]:
    """The collectives (op path) an fsdp plan with `gradient_mode` needs that the profile's table lacks."""
    need = [("all_gather", FSDP_GATHER_PATH), ("reduce_scatter", FSDP_REDUCE_PATHS[gradient_mode])]
    return [f"{op} {path}" for op, path in need if not has_collective(table, op, path)]


def layouts(world_size: int, table, gradient_mode: str, stages: int = 1, *,
            node_size: Optional[int] = None) -> list[str]:
    """Layouts a plan with `gradient_mode` may take on `world_size` ranks in nodes of `node_size` (None: one node):
    replicated where the mode runs replicas (bf16, quangrad8), fsdp when there are several ranks, no pipeline stages
    (`stages` 1) and the collectives table has FSDP2's all-gather and reduce-scatter (sdp4bit gradients: fsdp only,
    so none on one rank), and hsdp where the ranks span nodes, 1 < node_size < world_size, and the table times its
    collectives over a node and over the replicas (`hsdp_refusal` says why not; priced in agoq.search.hsdp)."""
    out = [REPLICATED] if gradient_mode in LAYOUT_GRADIENTS[REPLICATED] else []
    if world_size > 1 and stages == 1 and gradient_mode in LAYOUT_GRADIENTS[FSDP] \
            and not fsdp_missing(table, gradient_mode):
        out.append(FSDP)
    if hsdp_refusal(world_size, node_size, table, gradient_mode, stages) is None:
        out.append(HSDP)
    return out


# ------------------------------------------------------------------------------ hsdp: where it is offered

NODE, REPLICAS = "node", "replicas"  # the collectives table's groups HSDP runs over (agoq.search.collective_times)
HSDP_REDUCE_PATHS = {"bf16": "nccl-bf16", "quangrad8": "nccl-fp32", "sdp4bit": "sdp4bit"}  # in the node
HSDP_ALL_REDUCE_PATHS = {"bf16": "nccl-bf16", "quangrad8": "quangrad8", "sdp4bit": "tlq4"}  # across nodes
HSDP_GATHER_PATH = "nccl-bf16"


def hsdp_missing(table, gradient_mode: str) -> list[str]:
    """The collectives (op path over group) an hsdp plan with `gradient_mode` needs that the table lacks."""
    need = [("all_gather", HSDP_GATHER_PATH, NODE), ("reduce_scatter", HSDP_REDUCE_PATHS[gradient_mode], NODE),
            ("all_reduce", HSDP_ALL_REDUCE_PATHS[gradient_mode], REPLICAS)]
    return [f"{op} {path} over the {group} group" for op, path, group in need
            if not has_collective(table, op, path, group=group)]


def hsdp_refusal(world_size: int, node_size: Optional[int], table, gradient_mode: str,
                 stages: int = 1) -> Optional[str]:
    """Why layout hsdp is not offered (None: it is; agoq.search.hsdp's module docstring)."""
    if node_size is None or node_size >= world_size:
        return (f"the {world_size} rank(s) do not span nodes (one node of {node_size or world_size}): hsdp replicates "
                "across nodes; plan a cluster of several nodes with --world-size N --node-size S (1 < S < N)")
    if node_size <= 1:
        return ("nodes of one rank leave nothing to shard within a node (that is layout replicated): give "
                "--node-size S > 1")
    if world_size % node_size:
        return f"--node-size {node_size} does not divide the world's {world_size} ranks"
    if stages != 1:
        return f"hsdp is data parallelism over one pipeline stage, the profile has {stages}"
    if gradient_mode not in LAYOUT_GRADIENTS[HSDP]:
        return f"hsdp runs gradient mode(s) {', '.join(LAYOUT_GRADIENTS[HSDP])}, not {gradient_mode}"
    missing = hsdp_missing(table, gradient_mode)
    if missing:
        return (f"the collectives table lacks {', '.join(missing)} (a what-if's modelled table has them: give "
                "--world-size and --node-size)")
    return None


@dataclass(frozen=True)
class UnitSizes:
    """Values (parameters) of FSDP2's root unit and of one decoder layer."""

    root: int
    layer: int


def unit_sizes(config: Optional[dict], parameters: int, num_layers: int) -> UnitSizes:
    """The root unit's and one decoder layer's values from the model config (agoq.models.LlamaConfig's count); the
    root is `parameters` - num_layers x layer. Raises ValueError without a usable config."""
    if not config:
        raise ValueError("layout fsdp needs the model config in the profile (the size of a decoder layer)")
    from agoq.models.config import unit_values

    try:
        layer, root = unit_values(config, parameters, num_layers)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(f"layout fsdp: the profile's model config gives no layer size ({e})") from None
    return UnitSizes(root=max(0, root), layer=layer)


def fsdp_in_flight_bytes(units: UnitSizes, gradient_mode: str, elem_bytes: int = 2) -> float:
    """Unsharded bytes per rank during fwd + bwd: the root unit's and IN_FLIGHT_LAYERS layers' all-gathered weights
    plus one unit's gradients before their reduce-scatter (see the module docstring)."""
    weights = elem_bytes * (units.root + IN_FLIGHT_LAYERS * units.layer)
    return float(weights + REDUCE_BYTES[gradient_mode] * max(units.root, units.layer))


def gather_path(table, weight_gather: str, *, group: str = WORLD) -> tuple[str, float]:
    """(path, scale) FSDP2's weight all-gather in `weight_gather` over `group` (agoq.search.collective_times) is read
    off the table at scale x the float32 bytes: its own path (GATHER_PATHS) at scale 1 where the table has it, else
    the bf16 gather at its share of the bf16 bytes (GATHER_BYTES)."""
    own = GATHER_PATHS.get(weight_gather)
    if own is not None and has_collective(table, "all_gather", own, group=group):
        return own, 1.0
    return FSDP_GATHER_PATH, GATHER_BYTES[weight_gather] / GATHER_BYTES["bf16"]


def check_weight_gather(weight_gather: str) -> None:
    """ValueError unless `weight_gather` is one of GATHER_BYTES' wire formats."""
    if weight_gather not in GATHER_BYTES:
        raise ValueError(f"weight gather must be one of {', '.join(GATHER_BYTES)}, got {weight_gather!r}")


def fsdp_exposed_seconds(table, gradient_mode: str, units: UnitSizes, num_layers: int,
                         forward_backward: float, weight_gather: str = "bf16") -> dict:
    """Seconds of FSDP2's communication not hidden by compute, per micro-batch (see the module docstring), with
    its parts: {"exposed", "all_gather_layer", "reduce_scatter_layer", "all_gather_root", "reduce_scatter_root"}.
    `forward_backward`: seconds of one micro-batch's fwd + bwd. `weight_gather` (GATHER_BYTES): the all-gather's
    wire format, timed as the bf16 all-gather of the bytes it sends. Raises ValueError when the table lacks a path."""
    missing = fsdp_missing(table, gradient_mode)
    if missing:
        raise ValueError(f"layout fsdp with {gradient_mode} gradients needs the profile's collective timings of "
                         f"{', '.join(missing)} (agoq profile with several ranks measures them)")
    check_weight_gather(weight_gather)
    rs_path = FSDP_REDUCE_PATHS[gradient_mode]
    ag_path, wire = gather_path(table, weight_gather)
    ag_l = collective_seconds(table, ag_path, 4.0 * units.layer * wire, ("all_gather",))
    rs_l = collective_seconds(table, rs_path, 4.0 * units.layer, ("reduce_scatter",))
    ag_r = collective_seconds(table, ag_path, 4.0 * units.root * wire, ("all_gather",)) if units.root else 0.0
    rs_r = collective_seconds(table, rs_path, 4.0 * units.root, ("reduce_scatter",)) if units.root else 0.0
    if any(math.isnan(v) for v in (ag_l, rs_l, ag_r, rs_r)):
        raise ValueError("layout fsdp: a collective time could not be read off the profile's table")
    # the collectives' own kernels where the table gives them (agoq.search.collective_times): never hidden
    k_ag = min(ag_l, kernel_seconds(table, ag_path, 4.0 * units.layer * wire, ("all_gather",)))
    k_rs = min(rs_l, kernel_seconds(table, rs_path, 4.0 * units.layer, ("reduce_scatter",)))
    layer_fb = max(0.0, forward_backward) / num_layers
    exposed = num_layers * (max(0.0, ag_l - k_ag - layer_fb / 3.0) + k_ag
                            + max(0.0, ag_l - k_ag + rs_l - k_rs - 2.0 * layer_fb / 3.0) + k_ag + k_rs) \
        + 2.0 * ag_r + rs_r
    return {"exposed": exposed, "all_gather_layer": ag_l, "reduce_scatter_layer": rs_l, "all_gather_root": ag_r,
            "reduce_scatter_root": rs_r, "kernels_layer": k_ag + k_rs}


__all__ = ["LAYOUTS", "LAYOUT_GRADIENTS", "IN_FLIGHT_LAYERS", "GATHER_BYTES", "GATHER_PATHS", "gather_path", "UnitSizes", "default_layout", "resolve_layout",
           "layouts", "fsdp_missing", "unit_sizes", "fsdp_in_flight_bytes",
           "fsdp_exposed_seconds", "check_weight_gather", "NODE", "REPLICAS", "HSDP_REDUCE_PATHS", "HSDP_ALL_REDUCE_PATHS", "hsdp_missing",
           "hsdp_refusal"]
