"""Plan for a cluster one has not profiled: a profile of W ranks re-targeted to N ranks (`agoq search --world-size N
[--node-size G] [--network SPEC]`).

What the re-targeted profile prices, per rank (the search then runs as on any profile):

  compute        the profile's measured steps, unchanged: every rank runs the profiled micro-batch (and the
                 search's micro-batch x accumulation) on its own GPU, whatever N is
  communication  every collective the search reads (agoq.search.collective_times) from a table modelled at N
                 ranks in nodes of G (agoq.search.network): the profile's own link fitted to its measured
                 collectives (agoq.search.network_fit), or the --network links with the fitted kernels of the
                 quantized paths (`timed_kernels`: a path no measured collective gave a kernel, every path of a
                 one-GPU profile, takes the kernels the profile timed in one process, profile.json
                 collective_kernels); FSDP2's int8 weight all-gather (FSDP2 + TLq-HS + int8, a configuration the
                 search picks) on its own path, int8-weights (agoq.search.layouts.gather_path). Where the profile
                 measured layout steps, each layout's exposed communication is calibrated on them at the
                 profile's W ranks and re-priced by the model from W to N (agoq.search.layout_calibration); a
                 profile of one GPU measures one-rank FSDP2 (W = 1), whose step less the one-process compute is
                 FSDP2's own cost per step (seconds), added to the model's communication at N:
                 comm(X) = comm_model_N(X) + (R.step_seconds - compute(A))
  memory         the layout's dimensions at N: a sharded state is 1/N per rank (hsdp's 1/G, agoq.search.state),
                 FSDP2's units in flight by the layer sizes (agoq.search.layouts)

The modelled table has the profile table's columns (op, path, world_size, message_bytes, seconds, backend
"model") at message sizes 64 KiB .. 256 GiB, a factor 2^(1/4) apart, so the table's log-log interpolation reads the
model within a fraction of a percent (also where an all-reduce turns from tree to ring), and a column `group`
(agoq.search.collective_times): "world", every path over the N ranks in nodes of G; and where the ranks span nodes
(1 < G < N), the groups HSDP runs its collectives over (agoq.search.hsdp): "node", every path over the G ranks of
one node (Cluster(G, G), intra link only), and "replicas", every path over the N / G ranks of one shard, one per
node (Cluster(N / G, 1), inter link only). The re-targeted profile's `settings.node_size` is G. `WhatIf` records
what was measured and what is extrapolated, for the plan.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Optional

import pandas as pd

from agoq.formats.profile import ProfileData
from agoq.search.collective_times import WORLD
from agoq.search.layouts import NODE, REPLICAS
from agoq.search.network import INT4_LEVEL, OPERATIONS, Network
from agoq.search.network_fit import Fit, fit_collectives, fit_timed_kernels
from agoq.search.network_spec import parse_network

# 1 KiB .. 256 GiB, 2^(1/4) apart: a message below the table is extrapolated along its first two sizes' slope, which
# misses an affine latency + bytes / bandwidth by a few per cent (an HSDP shard of a small model's unit across nodes,
# 30 KB, read 4 % low off a table from 64 KiB); within it, log-log interpolation misses it by under 0.1 %
MODEL_SIZES = tuple(int(round(2 ** (s / 4))) // 4 * 4 for s in range(40, 153))
MODEL_PATHS = tuple(sorted(OPERATIONS))  # what the search reads (int8-/int4-weights: FSDP2's quantized gathers)
MAX_WORLD = 1 << 20


@dataclass(frozen=True)
class WhatIf:
    """A profile measured on `measured_world` ranks re-targeted to `world` ranks in nodes of `node_size` over
    `network` (with the `fit` of the profile's collectives, None where it measured none)."""

    measured_world: int
    world: int
    node_size: int
    network: Network
    fit: Optional[Fit]
    profile_path: str
    device: Optional[str] = None
    model_spec: str = "MODEL"
    layout_steps: int = 0  # layout steps the profile measured (agoq.formats.layout_steps)
    timed_kernels: tuple = ()  # (op, path) whose kernels come from the profile's one-process timing
    timed_device: Optional[str] = None  # where they were timed (agoq.formats.collective_kernels)

    @property
    def nodes(self) -> int:
        return self.world // self.node_size

    def extrapolated(self) -> list[str]:
        """Which figures of a plan come from the model rather than from a measurement at this size."""
        out = [f"communication: every collective at {self.world} ranks ({self.nodes} node(s) of {self.node_size}) "
               f"from the latency-bandwidth model ({self.network.name}), the profile measured {self.measured_world}",
               "step time and tokens/s: measured compute per rank plus the modelled communication; data ranks "
               f"{self.world} (tokens per step scale with them)",
               f"memory per rank: the layout's state at {self.world} ranks (fsdp: the state measured "
               f"whole, divided by {self.world}; "
               + (f"hsdp: divided by the node's {self.node_size}; " if 1 < self.node_size < self.world else "")
               + "replicated: whole, as measured)"]
        if self.timed_kernels:
            out.append("quantized collectives' kernels (" + ", ".join(f"{o} {p}" for o, p in self.timed_kernels)
                       + "): the runtime's quantize / Hadamard / dequantize kernels timed in one process"
                       + (f" on {self.timed_device}" if self.timed_device else "")
                       + " (the profile's collective_kernels, fixed + per value fitted over its sizes); the wire "
                       + ("from the profile's fitted link" if self.network.name == "profile"
                          else f"from the network ({self.network.name})"))
        out += self._int4_level_notes()
        if self.fit is None:
            carried = (" (the one-rank fsdp layout steps carry FSDP2's int8/int4 gathers' kernels, not TLq-HS's, "
                       "which one rank does not run)" if self.layout_steps and self.measured_world == 1 else "")
            if not self.timed_kernels:
                out.append("quantized collectives (quangrad8, sdp4bit, FSDP2's int8 weight all-gather): wire time "
                           f"only, their kernels were not measured (a profile of one rank){carried}")
            elif carried:
                out.append(f"FSDP2's weight all-gathers{carried}: a gather a one-rank layout step measured takes no "
                           "timed kernel (its step carries it)")
        else:
            for bits in ("int8", "int4"):
                key = ("all_gather", f"{bits}-weights")
                if key not in self.fit.kernels and key not in self.timed_kernels:
                    out.append(f"FSDP2's {bits} weight all-gather: wire time only, the profile's collectives do not "
                               "time its quantize and dequantize kernels (an fsdp layout step gathering so, where "
                               "the profile has one, carries them)")
        if 1 < self.node_size < self.world:
            tlq4 = ("all_reduce", "tlq4") in self.network.kernels
            out.append("hsdp (FSDP2 within a node, replicas across): its communication is the network model's, no "
                       "layout step calibrates it; TLq's 4-bit all-reduce across nodes (sdp4bit gradients) by its "
                       + ("wire time and its timed kernels" if tlq4 else "wire time only"))
        if self.layout_steps and self.measured_world == 1:
            out.append(f"layout steps: FSDP2's own cost per step measured in one process ({self.layout_steps} "
                       "one-rank fsdp step(s): the step less the one-process compute), added to the network "
                       f"model's communication at {self.world} ranks")
        elif self.layout_steps:
            out.append(f"layout steps: each layout's exposed communication measured at {self.measured_world} ranks, "
                       f"re-priced by the network model at {self.world} (the seconds compute hid there stay hidden)")
        if self.nodes > 1:
            out.append("across nodes: no network between nodes was measured; the inter link is "
                       + ("the profile's own link, fitted on one node" if self.network.name == "profile"
                          else f"{self.network.inter.describe()} ({self.network.source})"))
        return out

    def _int4_level_notes(self) -> list[str]:
        """What prices the kernels of TLq-HS's int4 level across nodes (agoq.search.network's formula), where the
        ranks span nodes."""
        if self.nodes <= 1:
            return []
        if self.node_size == 1:  # no int8 level: K8 prices the int4 level's one quantization of the same values
            return ["TLq-HS with one rank per node runs its int4 level only: its kernels are priced by the int8 "
                    "level's (reduce_scatter sdp4bit) over the same values, quantized once"] \
                if ("reduce_scatter", "sdp4bit") in self.network.kernels else []
        if INT4_LEVEL in self.network.kernels:
            return [f"TLq-HS's int4 level across nodes: its own kernels ({INT4_LEVEL[0]} {INT4_LEVEL[1]}, timed in "
                    f"one process) over the node's 1/{self.node_size} of the values, added to the int8 level's"]
        return ["TLq-HS's int4-level kernels are not in the price: its int4 level across nodes (quantize, dequantize "
                f"and sum the node's 1/{self.node_size} of the values) was not timed (a profile whose "
                "collective_kernels are version 1, or none, or kernels fitted to collectives measured on one node); "
                "its wire is; a profile made by this agoq times it"]

    def check_command(self, model: str) -> str:
        """What to run first on the real cluster, on one of its nodes: agoq profile under torchrun, which measures
        the node's collectives among its ranks (MODEL: the profile's model; PROFILE_DIR a placeholder)."""
        return f"torchrun --nproc-per-node {self.node_size} -m agoq.cli profile {model} --out PROFILE_DIR"

    def check_then(self) -> str:
        """What to do with that profile (and how to measure the link between nodes too)."""
        across = (f"; to measure the link between nodes as well, run it over two nodes (torchrun --nnodes 2 "
                  f"--nproc-per-node {self.node_size} --rdzv-endpoint HOST:PORT ...)") if self.nodes > 1 else ""
        return (f"then plan again from it: agoq search --profile PROFILE_DIR --world-size {self.world} "
                f"--node-size {self.node_size} (its own fitted links inside the node){across}")

    def launch_command(self, plan=None) -> str:
        """How `plan` (its derived launch line, agoq.parallel_dims.launch_of; None: agoq train's plain line) is
        launched over the cluster's nodes (MODEL, PLAN.json and HOST:PORT are placeholders)."""
        nodes = (f"torchrun --nnodes {self.nodes} --nproc-per-node {self.node_size} --rdzv-backend c10d "
                 "--rdzv-endpoint HOST:PORT")
        single = f"torchrun --nproc-per-node {self.world} "
        line = "" if plan is None else str((plan.to_dict().get("launch") or {}).get("command") or "")
        if line.startswith(single):
            return nodes + " " + line[len(single):]
        return f"{nodes} -m agoq.train MODEL --plan PLAN.json"

    def record(self, plan=None) -> dict:
        """`plan`'s `whatif` section (agoq.formats.plan_whatif)."""
        return {"measured_world_size": self.measured_world, "world_size": self.world, "node_size": self.node_size,
                "nodes": self.nodes, "profile": self.profile_path, "measured_device": self.device,
                "network": {"name": self.network.name, "source": self.network.source,
                            "intra": {"bandwidth_bytes_per_second": self.network.intra.bandwidth,
                                      "latency_seconds": self.network.intra.latency},
                            "inter": {"bandwidth_bytes_per_second": self.network.inter.bandwidth,
                                      "latency_seconds": self.network.inter.latency}},
                "fit": None if self.fit is None else self.fit.summary(),
                "extrapolated": self.extrapolated(), "check_first": self.check_command(self.model_spec),
                "check_then": self.check_then(),
                "launch": self.launch_command(plan)}

    def lines(self) -> list[str]:
        """The printout's what-if lines."""
        out = [f"what-if: planned for {self.world} ranks ({self.nodes} node(s) of {self.node_size}), measured on "
               f"{self.measured_world}; network {self.network.describe()}"]
        if self.fit is not None:
            out += ["  " + line for line in self.fit.lines()]
        out += [f"  extrapolated: {e}" for e in self.extrapolated()]
        return out

    def summary_lines(self, plan) -> list[str]:
        """The search's printout of a what-if plan: the what-if, the cluster's tokens/s, what to run first."""
        dims = plan.dims()
        data_ranks = dims.data_ranks if dims is not None else self.world
        per_rank = plan.decision.tokens_per_second if plan.decision is not None else None
        out = self.lines()
        if per_rank:
            out.append(f"  cluster: {per_rank * data_ranks:,.0f} tokens/s predicted over {data_ranks} data ranks "
                       f"({per_rank:,.0f} per rank); launch: {self.launch_command(plan)}")
        out.append(f"  not measured on that cluster: run first, on one of its nodes: "
                   f"{self.check_command(self.model_spec)}; {self.check_then()}")
        return out


def default_node_size(profile: ProfileData, world: int) -> int:
    """The profiled machine's GPUs (hardware.count; the profile's ranks where it says none), at most `world`."""
    count = profile.header.get("hardware", {}).get("count") or profile.world_size
    return max(1, min(int(count), world))


def modelled_table(network: Network, world: int, node_size: int, compute_kernels: tuple = ()) -> pd.DataFrame:
    """The collectives table the search reads, modelled at `world` ranks in nodes of `node_size`, with HSDP's groups
    where the ranks span nodes (see the module docstring). For the (op, path) in `compute_kernels` (the kernels timed
    in one process; TLq-HS's int4 level's counts in its reduce-scatter, Network.kernel_parts) the column
    `kernel_seconds` gives their part of the seconds, which the layouts price as compute, not hidden
    (agoq.search.collective_times)."""
    groups = [(WORLD, world, node_size)]
    if 1 < node_size < world:
        groups += [(NODE, node_size, node_size), (REPLICAS, world // node_size, 1)]
    rows = [{"op": op, "path": path, "world_size": ranks, "message_bytes": size,
             "seconds": network.seconds(op, path, float(size), ranks, size_of_node), "backend": "model",
             "group": group,
             "kernel_seconds": sum((s for key, s in network.kernel_parts(op, path, float(size), ranks, size_of_node)
                                    if key in compute_kernels), 0.0)}
            for group, ranks, size_of_node in groups for op, path in MODEL_PATHS for size in MODEL_SIZES]
    return pd.DataFrame(rows)


def check_sizes(world: int, node_size: Optional[int]) -> None:
    """ValueError naming the flag when --world-size / --node-size cannot describe a cluster."""
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"--world-size must be a whole number from 1 to {MAX_WORLD}, got {world!r}")
    if node_size is not None:
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
            raise ValueError(f"--node-size must be a whole number >= 1, got {node_size!r}")
        if world % node_size:
            near = sorted({n * node_size for n in (world // node_size, world // node_size + 1) if n >= 1})
            raise ValueError(f"--world-size {world} is not a multiple of --node-size {node_size}: every node holds "
                             f"the same number of ranks; give a world size of whole nodes (e.g. "
                             f"{' or '.join(map(str, near))}), or another --node-size")


def retarget(profile: ProfileData, world: int, node_size: Optional[int] = None,
             network: Optional[str | Network] = None) -> tuple[ProfileData, WhatIf]:
    """`profile` re-targeted to `world` ranks in nodes of `node_size` (None: `default_node_size`) over `network` (a
    --network SPEC or a Network; None: the profile's own link, fitted to its collectives). Returns the new
    ProfileData (the given one is left as it is) and its WhatIf. ValueError saying what to give otherwise."""
    check_sizes(world, node_size)
    if node_size is None:
        node_size = default_node_size(profile, world)
        if world % node_size:
            raise ValueError(f"--world-size {world} is not a multiple of the profiled machine's {node_size} GPUs "
                             "(the default node size): give --node-size")
    if profile.settings.get("pipeline_stages", 1) not in (None, 1):
        raise ValueError("a what-if plan re-targets data parallelism; this profile was made for pipeline stages: "
                         "profile without --pipeline-stages")
    table = profile.collectives
    fit = None
    if table is not None and len(table):
        try:
            fit = fit_collectives(table)
        except ValueError:
            if network is None:  # the profile's own link is all there is: say why it cannot be had
                raise
    if isinstance(network, str):
        network = parse_network(network)
    if network is None:
        if fit is None:
            fit_collectives(table)  # raises: says to give --network
        network = fit.network()
    elif fit is not None:
        network = network.with_kernels(fit.kernels)
    timed = timed_kernels(profile, network.kernels)
    if timed:  # paths no measured collective gave a kernel: the one-process timing's
        network = network.with_kernels({**timed, **network.kernels})
    header = copy.deepcopy(profile.header)
    header["settings"] = {**header.get("settings", {}), "world_size": world, "node_size": node_size}
    measured = profile.measured if profile.measured is not None else profile
    table = modelled_table(network, world, node_size, tuple(timed))
    target = dataclasses.replace(profile, header=header, collectives=table,
                                 notes=list(profile.notes), cache={}, measured=measured)
    device = profile.header.get("hardware", {}).get("name")
    model = profile.header.get("model", {})
    spec = str(model.get("spec") or model.get("name") or "MODEL")
    steps = len(measured.layout_steps())  # at one rank: one-rank FSDP2's (agoq.search.layout_calibration)
    timed_on = (profile.header.get("collective_kernels") or {}).get("device") if timed else None
    return target, WhatIf(profile.world_size, world, node_size, network, fit, str(profile.path), device, spec,
                          steps, tuple(sorted(timed)), timed_on)


def timed_kernels(profile: ProfileData, fitted: dict) -> dict:
    """{(op, path): Kernel} of the profile's collective kernels timed in one process (agoq.formats.collective_kernels,
    fitted by agoq.search.network_fit.fit_timed_kernels) for the paths `fitted` (kernels measured inside real
    collectives, which win) lacks; {} for a profile without them. A profile of one rank whose layout steps measured
    an fsdp step gathering its weights in int8 / int4 keeps that gather's kernels out: the step carries them
    (agoq.search.layout_calibration)."""
    rows = profile.collective_kernels()
    if not rows:
        return {}
    measured = profile.measured if profile.measured is not None else profile
    carried = set()
    if measured.world_size == 1:
        carried = {("all_gather", f"{r['weight_gather']}-weights") for r in measured.layout_steps()
                   if r.get("layout") == "fsdp" and r.get("weight_gather") not in (None, "bf16")}
    return {key: k for key, k in fit_timed_kernels(rows).items() if key not in fitted and key not in carried}


def mark_plans(outcome, whatif: WhatIf) -> None:
    """Every plan of a search outcome (the plan and the front's) says it is `whatif`'s (plan section `whatif`) and
    gives the nodes it was priced over (`parallel.ranks_per_node` = the node size)."""
    from agoq.formats.plan_whatif import WhatIf as Section

    plans = [outcome.plan] + [c.plan for c in outcome.candidates if getattr(c, "plan", None) is not None]
    for plan in {id(p): p for p in plans}.values():
        if plan.parallel is not None and plan.parallel.pipeline == 1:
            plan.parallel.ranks_per_node = whatif.node_size  # the nodes the plan was priced over
        plan.whatif = Section(**whatif.record(plan))


__all__ = ["WhatIf", "retarget", "timed_kernels", "mark_plans", "modelled_table", "default_node_size", "check_sizes", "MODEL_SIZES"]
