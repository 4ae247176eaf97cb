"""`--network SPEC`: the links of a cluster one has not profiled, as figures or a named preset.

SPEC is either `intra=GBps@us,inter=GBps@us` (GB/s = 1e9 bytes per second of one rank's share of the link, one
direction; us: microseconds of latency per message step), or one preset name below, or two joined by `+` (the
first's intra link, the second's inter link: `nvlink-h100+roce-100g`). A preset names one link kind; as SPEC it
is used for both levels unless joined.

Presets: bandwidth is the vendor's published figure, per GPU and per direction; latency is the order of one
NCCL message step on that link (vendors publish switch/port latencies of 0.1-1 us, NCCL's own per-step
overheads dominate and are our assumption, stated as such):

  name          bandwidth per GPU  latency  source
  nvlink-h100   450 GB/s           3 us     NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both directions)
  nvlink-a100   300 GB/s           3 us     NVIDIA A100 datasheet: NVLink 600 GB/s (both directions)
  nvlink-h800   200 GB/s           3 us     NVIDIA H800 SXM: NVLink 400 GB/s (both directions)
  pcie-gen4     32 GB/s            5 us     PCI-SIG: PCIe 4.0 x16, 16 GT/s x 16 lanes, about 32 GB/s per direction
  ib-ndr400     50 GB/s            5 us     NVIDIA ConnectX-7 / Quantum-2: NDR InfiniBand 400 Gb/s per port, one
                                            port per GPU (DGX H100: 8 x 400 Gb/s)
  ib-hdr200     25 GB/s            5 us     NVIDIA ConnectX-6: HDR InfiniBand 200 Gb/s per port, one per GPU
                                            (DGX A100: 8 x 200 Gb/s)
  roce-100g     12.5 GB/s          10 us    IEEE 802.3 100 GbE (RoCE v2), one 100 Gb/s port per GPU
  ethernet-25g  0.39 GB/s          30 us    IEEE 802.3 25 GbE, one 25 Gb/s port per node of 8 GPUs (3.125 GB/s / 8)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agoq.search.network import Link, Network
from agoq.units import excerpt

US, GB = 1e-6, 1e9


@dataclass(frozen=True)
class Preset:
    """A link kind with its published bandwidth per GPU (bytes/s), an assumed step latency (s), and the source."""

    name: str
    bandwidth: float
    latency: float
    source: str

    @property
    def link(self) -> Link:
        return Link(self.bandwidth, self.latency)


PRESETS = {p.name: p for p in (
    Preset("nvlink-h100", 450 * GB, 3 * US, "NVIDIA H100 SXM datasheet: NVLink 900 GB/s both directions"),
    Preset("nvlink-a100", 300 * GB, 3 * US, "NVIDIA A100 datasheet: NVLink 600 GB/s both directions"),
    Preset("nvlink-h800", 200 * GB, 3 * US, "NVIDIA H800 SXM: NVLink 400 GB/s both directions"),
    Preset("pcie-gen4", 32 * GB, 5 * US, "PCI-SIG PCIe 4.0 x16: about 32 GB/s per direction"),
    Preset("ib-ndr400", 50 * GB, 5 * US, "NVIDIA ConnectX-7 NDR InfiniBand: 400 Gb/s per port, one port per GPU"),
    Preset("ib-hdr200", 25 * GB, 5 * US, "NVIDIA ConnectX-6 HDR InfiniBand: 200 Gb/s per port, one port per GPU"),
    Preset("roce-100g", 12.5 * GB, 10 * US, "IEEE 802.3 100 GbE (RoCE v2): 100 Gb/s per port, one port per GPU"),
    Preset("ethernet-25g", 25 / 8 / 8 * GB, 30 * US,
           "IEEE 802.3 25 GbE: 25 Gb/s per node, shared by its 8 GPUs"),
)}
_LINK = re.compile(r"^\s*(intra|inter)\s*=\s*([0-9.eE+-]+)\s*(?:GB/?s|GBps)?\s*@\s*([0-9.eE+-]+)\s*(?:us)?\s*$")
SPEC_HELP = ("intra=GBps@us,inter=GBps@us (one rank's share of each link, one direction; latency per message step), "
             f"a preset ({', '.join(PRESETS)}), or INTRA+INTER presets, e.g. nvlink-h100+ib-ndr400")


def _preset(name: str, spec: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown network {excerpt(spec)}: give {SPEC_HELP}")
    return PRESETS[name]


def parse_network(spec: str) -> Network:
    """The Network of a --network SPEC (see the module docstring); ValueError saying what is accepted."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--network needs a value: {SPEC_HELP}")
    text = spec.strip()
    if "=" not in text:
        names = [n.strip() for n in text.split("+")]
        if len(names) > 2 or not all(names):
            raise ValueError(f"--network {excerpt(spec)}: join at most two presets with '+' (intra+inter)")
        intra, inter = _preset(names[0], spec), _preset(names[-1], spec)
        sources = intra.source if intra is inter else f"intra: {intra.source}; inter: {inter.source}"
        return Network(intra.link, inter.link, text, f"preset ({sources})")
    links = {}
    for part in text.split(","):
        m = _LINK.match(part)
        if not m:
            raise ValueError(f"--network {excerpt(spec)}: {excerpt(part)} is not LINK=GBps@us; give {SPEC_HELP}")
        level, gbps, us = m.group(1), float(m.group(2)), float(m.group(3))
        if level in links:
            raise ValueError(f"--network {excerpt(spec)}: {level} given twice")
        try:
            links[level] = Link(gbps * GB, us * US)
        except ValueError as e:
            raise ValueError(f"--network {excerpt(spec)}: {level}: {e}") from None
    if set(links) != {"intra", "inter"}:
        raise ValueError(f"--network {excerpt(spec)}: give both intra=GBps@us and inter=GBps@us")
    return Network(links["intra"], links["inter"], text, "given on the command line")


__all__ = ["Preset", "PRESETS", "SPEC_HELP", "parse_network"]
