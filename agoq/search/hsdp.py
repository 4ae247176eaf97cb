"""Layout hsdp: PyTorch's FSDP2 over replicate R x shard S ranks (`agoq train --parallel hsdp --node-size S`,
agoq.runtime.comm.hsdp), priced where the ranks span nodes: N ranks in R = N / S nodes of S, 1 < S < N.

Offered (agoq.search.layouts.layouts; its `hsdp_refusal` says why not) only where the search knows the node: a
what-if re-targeted to N ranks in nodes of S (`agoq search --world-size N --node-size S`, agoq.search.whatif), whose
modelled collectives table times the two groups HSDP runs over (agoq.search.collective_times). S = N is layout fsdp
(one node, no replicas); S = 1 would replicate whole models (layout replicated); a profile measured on one machine
has S = N, so it offers no hsdp.

The gradients, per gradient mode (agoq.train.fsdp_strategy):

  mode       within the node (reduce-scatter, "node")    across nodes (all-reduce of the shard, "replicas")
  bf16       nccl-bf16 (FSDP2's own, bf16)               nccl-bf16: FSDP2's native HSDP, deferred to the step's
                                                         last micro-batch (the shards of the micro-batches summed)
  quangrad8  nccl-fp32 (FSDP2's exact, float32)          quangrad8: QuanGrad's 8-bit all-reduce, every micro-batch
  sdp4bit    sdp4bit (TLq-HS: int8 all-to-all in-node)   tlq4: TLq's 4-bit all-reduce, every micro-batch

Memory per rank, bytes: as layout fsdp (agoq.search.layouts) with the state sharded over the S ranks of a node:

  sharded   = (W + G + M + A) / S                         (agoq.search.state.state_per_rank)
  in flight = e x (n_root + IN_FLIGHT_LAYERS x n_layer) + g x max(n_root, n_layer)    (as fsdp; g = 4 for quangrad8
              and sdp4bit, which reduce from float32). The cross-node all-reduce works on the 1/S shard in place
              (its quantized codes are < 1/S of a unit: not counted)

Time per step, seconds. With ag(n), rs(n) the all-gather and reduce-scatter over the node's S ranks of a message of
4 x n bytes (the float32 bytes of n values, as the table; the paths above, the weight gather's as fsdp's), ar(n)
the all-reduce over the R replicas of the node's shard, 4 x n / S bytes, fb one micro-batch's fwd + bwd, L decoder
layers, a layer's compute fb / L, a third of it forward. The shard's all-reduce follows its reduce-scatter on
FSDP2's communication stream and is hidden, like it, under the backward of the layers computed next; the two are
counted one after the other (the intra and inter links could overlap them: this is the upper end):

  exposed(a) = L x max(0, ag(n_layer) - fb / (3 L))                                  forward
             + L x max(0, ag(n_layer) + rs(n_layer) + a x ar(n_layer) - 2 fb / (3 L))  backward
             + 2 ag(n_root) + rs(n_root) + a x ar(n_root)                            the root unit's, not hidden

  (a collective's own kernels, where the table gives them, are taken out of what may hide and added whole, as
  for fsdp: agoq.search.layouts)

  communication = (accum - 1) x exposed(0) + exposed(1)     bf16: the all-reduce on the last micro-batch only
                = accum x exposed(1)                        quangrad8, sdp4bit: every micro-batch
  step = accum x fb + optimizer seconds / S + communication

The optimizer step runs over 1/S of the state. No layout step of the profile calibrates hsdp (the profiler measures
none): its communication is the network model's.
"""

from __future__ import annotations

import math

from agoq.search.collective_times import collective_seconds, kernel_seconds
from agoq.search.layouts import (  # what hsdp is offered with (layouts.hsdp_refusal) and reads its collectives by
    HSDP_ALL_REDUCE_PATHS,
    HSDP_REDUCE_PATHS,
    NODE,
    REPLICAS,
    UnitSizes,
    check_weight_gather,
    gather_path,
    hsdp_missing,
    hsdp_refusal,
)
from agoq.vocabulary import BF16


def hsdp_exposed_seconds(table, gradient_mode: str, units: UnitSizes, num_layers: int, forward_backward: float,
                         grad_accum: int, weight_gather: str = "bf16") -> dict:
    """Seconds per step of HSDP's communication not hidden by compute (module docstring), with its parts per micro-
    batch and unit: {"exposed", "all_gather_layer", "reduce_scatter_layer", "all_reduce_layer", "all_gather_root",
    "reduce_scatter_root", "all_reduce_root"}. Raises ValueError when the table lacks a collective."""
    missing = hsdp_missing(table, gradient_mode)
    if missing:
        raise ValueError(f"layout hsdp with {gradient_mode} gradients needs the collective timings of "
                         f"{', '.join(missing)}: plan it as a what-if over several nodes (--world-size, --node-size)")
    check_weight_gather(weight_gather)
    shard = float(table.loc[table["group"] == NODE, "world_size"].iloc[0])  # S: the node's ranks
    ag_path, wire = gather_path(table, weight_gather, group=NODE)
    rs_path, ar_path = HSDP_REDUCE_PATHS[gradient_mode], HSDP_ALL_REDUCE_PATHS[gradient_mode]

    def times(n: int) -> tuple[float, float, float]:
        if not n:
            return 0.0, 0.0, 0.0
        return (collective_seconds(table, ag_path, 4.0 * n * wire, ("all_gather",), group=NODE),
                collective_seconds(table, rs_path, 4.0 * n, ("reduce_scatter",), group=NODE),
                collective_seconds(table, ar_path, 4.0 * n / shard, ("all_reduce",), group=REPLICAS))

    ag_l, rs_l, ar_l = times(units.layer)
    ag_r, rs_r, ar_r = times(units.root)
    if any(math.isnan(v) for v in (ag_l, rs_l, ar_l, ag_r, rs_r, ar_r)):
        raise ValueError("layout hsdp: a collective time could not be read off the collectives table")
    # the collectives' own kernels where the table gives them: never hidden (agoq.search.layouts)
    n = units.layer
    k_ag = min(ag_l, kernel_seconds(table, ag_path, 4.0 * n * wire, ("all_gather",), group=NODE))
    k_rs = min(rs_l, kernel_seconds(table, rs_path, 4.0 * n, ("reduce_scatter",), group=NODE))
    k_ar = min(ar_l, kernel_seconds(table, ar_path, 4.0 * n / shard, ("all_reduce",), group=REPLICAS))
    layer_fb = max(0.0, forward_backward) / num_layers

    def exposed(a: float) -> float:
        forward = max(0.0, ag_l - k_ag - layer_fb / 3.0) + k_ag
        backward = max(0.0, ag_l - k_ag + rs_l - k_rs + a * (ar_l - k_ar) - 2.0 * layer_fb / 3.0) \
            + k_ag + k_rs + a * k_ar
        return num_layers * (forward + backward) + 2.0 * ag_r + rs_r + a * ar_r

    accum = int(grad_accum)
    step = (accum - 1) * exposed(0.0) + exposed(1.0) if gradient_mode == BF16 else accum * exposed(1.0)
    return {"exposed": step, "all_gather_layer": ag_l, "reduce_scatter_layer": rs_l, "all_reduce_layer": ar_l,
            "all_gather_root": ag_r, "reduce_scatter_root": rs_r, "all_reduce_root": ar_r}


__all__ = ["NODE", "REPLICAS", "HSDP_REDUCE_PATHS", "HSDP_ALL_REDUCE_PATHS", "hsdp_missing", "hsdp_refusal",
           "hsdp_exposed_seconds"]
