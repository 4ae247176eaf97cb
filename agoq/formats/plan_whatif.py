"""A plan's `whatif` section (schema agoq.plan/1.9, additive): the plan was made for a cluster its profile was not
measured on (`agoq search --world-size N`, agoq.search.whatif), and says so.

  measured_world_size  ranks the profile measured (its collectives and steps)
  world_size           ranks the plan is for; node_size ranks per node, nodes = world_size / node_size
  profile              the profile's folder; measured_device the GPU it ran on
  network              {name, source, intra, inter}: each link's bandwidth_bytes_per_second and latency_seconds;
                       name "profile" = fitted to the profile's collectives, else a preset or the user's figures
  fit                  the fit to the profile's collectives (null: it measured none): latency_seconds,
                       bandwidth_bytes_per_second, rows, residuals per path {rms, worst} (relative), kernels
  extrapolated         which figures come from the model rather than a measurement at this size (sentences)
  check_first          what to run first on the real cluster to check the plan (agoq profile under torchrun)
  check_then           what to do with that profile (search again from it; how to measure across nodes)
  launch               how to launch it over the nodes (MODEL, PLAN.json, HOST:PORT are placeholders)

A plan without the section (every plan before 1.9, and any plan searched for its profile's own world) was made for
the world its profile measured.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, model_validator

from agoq.formats.plan_sections import _Part


class WhatIf(_Part):
    """The `whatif` section (see the module docstring)."""

    measured_world_size: int = Field(ge=1)
    world_size: int = Field(ge=1)
    node_size: int = Field(ge=1)
    nodes: Optional[int] = Field(default=None, ge=1)
    profile: Optional[str] = None
    measured_device: Optional[str] = None
    network: dict[str, Any]
    fit: Optional[dict[str, Any]] = None
    extrapolated: list[str] = Field(default_factory=list)
    check_first: str
    check_then: Optional[str] = None
    launch: Optional[str] = None

    @model_validator(mode="after")
    def _whole_nodes(self) -> "WhatIf":
        if self.world_size % self.node_size:
            raise ValueError(f"world_size {self.world_size} is not a whole number of nodes of {self.node_size}")
        if self.nodes is not None and self.nodes * self.node_size != self.world_size:
            raise ValueError(f"nodes {self.nodes} x node_size {self.node_size} is not world_size {self.world_size}")
        for level in ("intra", "inter"):
            link = self.network.get(level)
            if not isinstance(link, dict) or not (link.get("bandwidth_bytes_per_second") or 0) > 0:
                raise ValueError(f"network.{level} needs bandwidth_bytes_per_second > 0")
        return self


__all__ = ["WhatIf"]
