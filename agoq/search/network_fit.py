"""Fit the latency-bandwidth model (agoq.search.network) to a profile's measured collectives.

The profile's table (agoq.profiler.collectives: op, path, world_size, message_bytes, seconds) was measured on W ranks
of one machine: one node of W ranks, every message on one link. For each NCCL row (nccl-fp32, nccl-bf16; all-reduce,
reduce-scatter, all-gather) the model's time is linear in the link's two unknowns,

  t = s x alpha + b x (1 / beta)      s: message steps, b: bytes one rank sends (agoq.search.network's ring terms)

and alpha, 1 / beta >= 0 are fitted by non-negative least squares on the relative error (each row divided by its
measured seconds, so a 1 MiB message counts as much as a 1 GiB one); an all-reduce takes the ring's terms, then,
refitted until the choice settles, the tree's where the fitted link runs it faster (as the model prices it). A quantized path (quangrad8, sdp4bit) then
gets its kernels from what the wire does not explain: residual r = t - wire(t) fitted as fixed + per_value x n
(n values; non-negative least squares, relative). `Fit.rows` holds every row's measured and modelled seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from agoq.search.network import NCCL_PATHS, OPERATIONS, WIRE_BYTES, Kernel, Link, Network

FIT_ROUNDS = 5  # refits as the all-reduces' ring-or-tree choice settles


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    return nnls(a, b)[0]


def link_features(op: str, path: str, message_bytes: float, world: int,
                  link: Optional[Link] = None) -> tuple[float, float]:
    """(steps, bytes) of NCCL's `op` on `path` among `world` ranks of one node: its time is steps x alpha +
    bytes / beta. Ring terms (all-reduce 2 (P - 1) steps and 2 (P - 1) / P of the bytes, the others P - 1 and
    (P - 1) / P), or, for an all-reduce that `link` runs faster as a tree (agoq.search.network), the tree's
    (2 ceil(log2 P) steps, 2 x the bytes)."""
    if path not in NCCL_PATHS:
        raise ValueError(f"a link is fitted to NCCL's own paths ({', '.join(NCCL_PATHS)}), not {path}")
    nbytes = message_bytes / 4.0 * WIRE_BYTES[path]
    if op != "all_reduce":
        return world - 1, (world - 1) / world * nbytes
    ring = (2 * (world - 1), 2 * (world - 1) / world * nbytes)
    tree = (2 * math.ceil(math.log2(world)), 2 * nbytes) if world > 1 else ring
    if link is not None and link.seconds(*tree) < link.seconds(*ring):
        return tree
    return ring


def fit_link(samples: list[tuple[float, float, float]]) -> Link:
    """The Link (alpha, beta) of (steps, bytes, seconds) samples, least squares on the relative error; ValueError
    when the samples cannot tell a bandwidth."""
    if len(samples) < 2:
        raise ValueError("fitting a link needs at least two measured collectives")
    a = np.array([[s / t, b / t] for s, b, t in samples], dtype=float)
    alpha, inv_beta = _nnls(a, np.ones(len(samples)))
    if not inv_beta > 0:
        raise ValueError("the measured collectives do not grow with the message: no bandwidth can be fitted")
    return Link(1.0 / float(inv_beta), float(alpha))


def fit_kernel(samples: list[tuple[float, float]]) -> Kernel:
    """The Kernel (fixed, per_value) of (values, residual seconds, measured seconds) samples, relative least squares."""
    if not samples:
        return Kernel()
    a = np.array([[1.0 / t, n / t] for n, _, t in samples], dtype=float)
    b = np.array([r / t for _, r, t in samples], dtype=float)
    fixed, per_value = _nnls(a, b)
    return Kernel(float(fixed), float(per_value))


def fit_timed_kernels(rows: list[dict]) -> dict:
    """{(op, path): Kernel} of a profile's collective kernels timed in one process (agoq.formats.collective_kernels
    rows {op, path, message_bytes, seconds}): per path, seconds = fixed + per_value x n (n = message_bytes / 4
    values) by `fit_kernel` (the whole time is the kernels': no wire)."""
    paths = sorted({(r["op"], r["path"]) for r in rows})
    return {key: fit_kernel([(float(r["message_bytes"]) / 4.0, float(r["seconds"]), float(r["seconds"]))
                             for r in rows if (r["op"], r["path"]) == key]) for key in paths}


@dataclass
class Fit:
    """A link fitted to a profile's collectives on `world` ranks (one node), the quantized paths' kernels and every
    row: {op, path, message_bytes, measured, modelled, residual (modelled / measured - 1)}."""

    link: Link
    world: int
    kernels: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    def network(self) -> Network:
        """The profile's own links: the fitted one inside and across nodes (one node was measured)."""
        return Network(self.link, self.link, "profile",
                       f"fitted to the profile's collectives on {self.world} ranks of one node (both links)",
                       dict(self.kernels))

    def residuals(self, path: str | None = None) -> np.ndarray:
        return np.array([r["residual"] for r in self.rows if path is None or r["path"] == path], dtype=float)

    def summary(self) -> dict:
        """The fit as a plan or a printout keeps it: alpha (s), beta (bytes/s), kernels, the RMS and worst relative
        residual over the NCCL rows and per path."""
        paths = sorted({r["path"] for r in self.rows})
        per_path = {p: {"rms": float(np.sqrt(np.mean(self.residuals(p) ** 2))),
                        "worst": float(np.max(np.abs(self.residuals(p))))} for p in paths}
        return {"latency_seconds": self.link.latency, "bandwidth_bytes_per_second": self.link.bandwidth,
                "measured_world_size": self.world, "rows": len(self.rows), "residuals": per_path,
                "kernels": {f"{op} {path}": {"fixed_seconds": k.fixed, "seconds_per_value": k.per_value}
                            for (op, path), k in sorted(self.kernels.items())}}

    def lines(self) -> list[str]:
        """The fit in words, one line per path."""
        s = self.summary()
        out = [f"network fit to {s['rows']} measured collectives on {self.world} ranks: alpha "
               f"{self.link.latency * 1e6:.3g} us, beta {self.link.bandwidth / 1e9:.4g} GB/s"]
        for path, r in s["residuals"].items():
            out.append(f"  {path}: relative residual RMS {r['rms']:.1%}, worst {r['worst']:.1%}")
        return out


def fit_collectives(table) -> Fit:
    """The Fit of a profile's collectives table (see the module docstring); ValueError when it has too few rows."""
    if table is None or not len(table):
        raise ValueError("the profile measured no collectives (profile with --world-size 2 or under torchrun), so "
                         "no network can be fitted to it: give --network (a preset or intra=GBps@us,inter=GBps@us)")
    worlds = sorted({int(w) for w in table["world_size"]}) if "world_size" in table.columns else [2]
    world = worlds[-1]
    rows = [r for r in table.to_dict("records") if int(r.get("world_size", world)) == world
            and (r["op"], r["path"]) in OPERATIONS and float(r["seconds"]) > 0]
    nccl = [r for r in rows if r["path"] in NCCL_PATHS]
    link = None
    for _ in range(FIT_ROUNDS):  # ring features first; then each all-reduce as the fitted link would run it
        features = [link_features(r["op"], r["path"], float(r["message_bytes"]), world, link) for r in nccl]
        fitted = fit_link([(*f, float(r["seconds"])) for f, r in zip(features, nccl)])
        if fitted == link:
            break
        link = fitted
    wire = Network(link, link, "fit", "fit")
    kernels = {}
    for op, path in sorted({(r["op"], r["path"]) for r in rows if r["path"] not in NCCL_PATHS}):
        mine = [r for r in rows if (r["op"], r["path"]) == (op, path)]
        kernels[(op, path)] = fit_kernel([(float(r["message_bytes"]) / 4.0,
                                           float(r["seconds"]) - wire.seconds(op, path, float(r["message_bytes"]),
                                                                              world, world),
                                           float(r["seconds"])) for r in mine])
    net = wire.with_kernels(kernels)
    out = []
    for r in rows:
        modelled = net.seconds(r["op"], r["path"], float(r["message_bytes"]), world, world)
        out.append({"op": r["op"], "path": r["path"], "message_bytes": int(r["message_bytes"]),
                    "measured": float(r["seconds"]), "modelled": modelled,
                    "residual": modelled / float(r["seconds"]) - 1.0})
    if not all(math.isfinite(r["modelled"]) for r in out):
        raise ValueError("the network fit gave a non-finite time: the profile's collectives table is not usable")
    return Fit(link, world, kernels, out)


__all__ = ["Fit", "fit_collectives", "fit_link", "fit_kernel", "fit_timed_kernels", "link_features"]
