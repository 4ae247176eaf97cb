"""The Profile folder (docs/formats.md): profile.json, profile.parquet (or .csv from older versions),
collectives.parquet. `write_profile_files` is its only writer (the profiler fills the header),
`load_profile` its only reader (checked, as `ProfileData`).
"""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from agoq.runtime.activations.policy import KINDS, RECOMPUTABLE
from agoq.files import json_safe, read_json_object, write_json, write_with
from agoq.formats.profile_header import (  # noqa: F401 (the header's checks, re-exported)
    HOST_LINK_RATES,
    PROFILE_SCHEMA_KIND,
    PROFILE_SCHEMA_MAJOR,
    REQUIRED_SECTIONS,
    SCHEMA,
    check_header,
)
from agoq.formats.views import read_profile_table

COLUMNS = ("layer", "kind", "option", "bits", "format", "shape", "bytes", "bytes_unshared", "bytes_measured",
           "quant_error", "sqnr_db", "sensitivity", "extra_seconds", "quantize_seconds", "dequantize_seconds",
           "recompute_seconds")
REQUIRED_COLUMNS = ("layer", "kind", "option", "bits", "format", "bytes", "sensitivity", "extra_seconds")


@dataclass
class ProfileData:
    """A profile as the search uses it: the JSON header, the per-(layer, kind, option) table, collectives."""

    path: Path
    header: dict[str, Any]
    table: pd.DataFrame
    collectives: Optional[pd.DataFrame] = None
    notes: list[str] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # what readers derive once
    # runs of plans made from this profile, as agoq.formats.run.measured_against_plan reads them: what really ran,
    # which the search's calibration learns from (agoq.search.calibration); given by the caller, not stored
    runs: list[dict] = field(default_factory=list, repr=False, compare=False)
    # the profile as measured, where this one re-targets it to another world (agoq.search.whatif); None: this one is
    measured: Optional["ProfileData"] = field(default=None, repr=False, compare=False)

    def with_runs(self, runs: list[dict]) -> "ProfileData":
        """This profile with the measured `runs` of its plans as evidence: a new ProfileData (with a cache of its own,
        since what the calibration derives depends on them); this one is left as it is."""
        return dataclasses.replace(self, runs=list(runs), cache={})

    @property
    def num_layers(self) -> int:
        """Decoder layers profiled."""
        return int(self.header["model"]["num_layers"])

    @property
    def settings(self) -> dict[str, Any]:
        return self.header.get("settings", {})

    @property
    def world_size(self) -> int:
        """Ranks the profile was measured over (`settings.world_size`; 1 where it says none): the world the search
        prices collectives, sharding and data ranks for."""
        return int(self.settings.get("world_size", 1) or 1)

    @property
    def node_size(self) -> int:
        """Ranks of one node among the world's (`settings.node_size`, which a what-if re-targeted profile sets to its
        --node-size, agoq.search.whatif; else the whole world: a profile measured on one machine): the search offers
        HSDP (replicas across nodes of shards within one) only where it is below the world."""
        return int(self.settings.get("node_size") or self.world_size)

    def layout_steps(self) -> list[dict]:
        """The multi-rank layout steps the profile measured (agoq.formats.layout_steps; [] where none), checked."""
        from agoq.formats.layout_steps import layout_rows

        return layout_rows(self.header, str(self.path / "profile.json"))

    def collective_kernels(self) -> list[dict]:
        """The quantized collectives' kernels timed in one process (agoq.formats.collective_kernels; [] where the
        profile has none), checked: rows {op, path, message_bytes, seconds}."""
        from agoq.formats.collective_kernels import kernel_rows

        return kernel_rows(self.header, str(self.path / "profile.json"))

    @property
    def memory(self) -> dict[str, Any]:
        return self.header.get("memory", {})

    @property
    def fingerprint(self) -> str:
        return self.header["model"]["fingerprint"]

    @property
    def model_name(self) -> str:
        m = self.header["model"]
        return str(m.get("name") or m.get("spec") or "model")

    @property
    def pipeline(self) -> dict[str, Any]:
        return self.header.get("pipeline") or {}

    def layer_stage(self) -> list[int]:
        """Pipeline stage of each layer (all 0 without a pipeline)."""
        stages = self.pipeline.get("layer_stage")
        return [int(s) for s in stages] if stages else [0] * self.num_layers

    def num_stages(self) -> int:
        return int(self.pipeline.get("stages") or 1)

    def in_flight(self, schedule: str = "1f1b") -> list[int]:
        """Micro-batches each stage holds at its peak under `schedule` (1 per stage when not profiled)."""
        table = self.pipeline.get("in_flight") or {}
        counts = table.get(schedule)
        if counts is None:
            if table:
                raise ValueError(f"{self.path}: the profile has in-flight counts for schedule(s) {sorted(table)}, "
                                 f"not {schedule!r}")
            return [1] * self.num_stages()
        return [int(c) for c in counts]

    def bf16_step_seconds(self) -> Optional[float]:
        """Measured step time of the plain bf16 model, if the profile has one."""
        for step in self.memory.get("steps", []) or []:
            if step.get("policy") == "bf16" and step.get("step_seconds") is not None:
                return float(step["step_seconds"])
        return None

    def model_config(self) -> Optional[dict]:
        return self.header["model"].get("config")

    @property
    def host_link(self) -> Optional[dict[str, Any]]:
        """The pinned host link measured under compute (agoq.profiler.host_link; docs/formats.md), None when not
        measured (CPU profiles, older profiles): `d2h_bytes_per_second`, `h2d_bytes_per_second` (bytes/s),
        `bytes_per_copy` (bytes), `compute_slowdown` (ratio >= 0), `pinnable_bytes` (bytes). Checked by load_profile."""
        return (self.header.get("timing") or {}).get("host_link")


def _check_table(table: pd.DataFrame, num_layers: int, where: Path) -> pd.DataFrame:
    missing = [c for c in REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing}")
    table = table.copy()
    for col in ("option", "kind"):  # checked before astype(str), which writes "nan" on pandas 2 and keeps NaN on 3
        empty = table[col].isna()
        if empty.any():
            raise ValueError(f"{where}: {col}: {int(empty.sum())} row(s) without a value, e.g. rows\n"
                             f"{table.loc[empty].head(3)}")
        table[col] = table[col].astype(str)
    bad_kinds = sorted(set(table["kind"]) - set(KINDS))
    if bad_kinds:
        raise ValueError(f"{where}: kind: unknown kind(s) {bad_kinds}; the kinds are {', '.join(KINDS)}")
    layers = set(int(v) for v in table["layer"])
    if layers != set(range(num_layers)):
        raise ValueError(f"{where}: layer: rows cover layers {sorted(layers)[:8]}..., expected 0..{num_layers - 1} "
                         "(profile.json model.num_layers)")
    for col in ("bytes", "sensitivity", "extra_seconds"):
        values = pd.to_numeric(table[col], errors="coerce")
        if values.isna().any() or (values < 0).any() or not values.map(math.isfinite).all():
            rows = table.loc[values.isna() | (values < 0)].head(3)
            raise ValueError(f"{where}: {col}: must be finite and >= 0; e.g. rows\n{rows}")
        table[col] = values.astype(float)
    table["bytes"] = table["bytes"].astype("int64")
    rec = table["option"] == "recompute"
    bad = table.loc[rec & ~table["kind"].isin(list(RECOMPUTABLE))]
    if len(bad):
        raise ValueError(f"{where}: option: 'recompute' given for kind(s) {sorted(set(bad['kind']))}, which cannot "
                         "be recomputed")
    sixteen = table[table["option"] == "16"].groupby(["layer", "kind"]).size()
    if len(sixteen) != num_layers * len(set(table["kind"])):
        raise ValueError(f"{where}: option: every (layer, kind) needs a '16' row (the tensor kept as is)")
    return table


def load_profile(path: str | Path) -> ProfileData:
    """Read and check a Profile folder (or its profile.json); raises FileNotFoundError / ValueError saying
    what is wrong."""
    folder = Path(path)
    if folder.name == "profile.json" and folder.is_file():
        folder = folder.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"profile folder not found: {folder} (make one with `agoq profile MODEL --out DIR`)")
    header_path = folder / "profile.json"
    if not header_path.is_file():
        raise FileNotFoundError(f"{header_path} not found: {folder} is not a complete profile folder")
    header = read_json_object(header_path, "profile header")
    check_header(header, str(header_path))
    files = header.get("files") or {}
    table_path = folder / (files.get("table") or "profile.parquet")
    if not table_path.is_file():
        raise FileNotFoundError(f"{table_path} not found: {folder} is not a complete profile folder")
    model = header["model"]
    table = _check_table(read_profile_table(table_path), int(model["num_layers"]), table_path)
    collectives = None
    coll_path = folder / (files.get("collectives") or "collectives.parquet")
    if coll_path.is_file():
        collectives = read_profile_table(coll_path)
    data = ProfileData(folder, header, table, collectives)
    data.collective_kernels()  # a malformed section is refused here, naming its field
    stages = data.layer_stage()
    if len(stages) != data.num_layers:
        raise ValueError(f"{header_path}: pipeline.layer_stage: {len(stages)} entries for {data.num_layers} layers")
    return data


def write_profile_files(out: Path, header: dict, rows: list[dict], collectives: list[dict] | None = None) -> dict:
    """Write a Profile folder atomically, file by file: the table of `rows` (COLUMNS) as profile.parquet,
    `collectives` (if any) as collectives.parquet, then profile.json = `header` with its "files" entry
    filled and non-finite numbers as null (written last, so a folder with a profile.json is complete).
    Returns the header as written."""
    out = Path(out)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table = table.astype({"layer": "int64", "bits": "int64", "bytes": "int64", "bytes_unshared": "int64"})
    table["bytes_measured"] = table["bytes_measured"].astype("Int64")
    write_with(out / "profile.parquet", lambda p: table.to_parquet(p, index=False))
    files = {"table": "profile.parquet"}
    if collectives is not None:
        write_with(out / "collectives.parquet", lambda p: pd.DataFrame(collectives).to_parquet(p, index=False))
        files["collectives"] = "collectives.parquet"
    header = {**header, "files": files}
    write_json(out / "profile.json", json_safe(header))
    return header


def add_measured_steps(out: Path, header: dict, rows: list[dict], failures: list[dict]) -> dict:
    """Add the measured steps (agoq.formats.measured_steps) to a written profile, replacing any before, and their
    failures; returns the header."""
    from agoq.formats.measured_steps import section

    header = dict(header)
    header["measured_steps"] = section(rows)
    header["failures"] = list(header.get("failures") or []) + list(failures)
    write_json(Path(out) / "profile.json", json_safe(header))
    return header


def add_collectives(out: Path, header: dict, rows: list[dict], failures: list[dict]) -> dict:
    """Add collective timings measured elsewhere (under torchrun) to a written profile; returns the header."""
    out = Path(out)
    write_with(out / "collectives.parquet", lambda p: pd.DataFrame(rows).to_parquet(p, index=False))
    header = dict(header)
    header["files"] = {**header["files"], "collectives": "collectives.parquet"}
    header["settings"] = {**header["settings"], "world_size": rows[0]["world_size"] if rows else None}
    header["failures"] = list(header["failures"]) + list(failures)
    write_json(out / "profile.json", json_safe(header))
    return header


def add_layout_steps(out: Path, header: dict, rows: list[dict], failures: list[dict], world_size: int) -> dict:
    """Add the multi-rank layout steps (agoq.formats.layout_steps) measured over `world_size` ranks to a written
    profile, replacing any before, and their failures; the header's schema becomes this agoq's (1.1, the first
    with the section). Returns the header."""
    from agoq.formats.layout_steps import section

    header = dict(header)
    header["schema"] = SCHEMA
    header["layout_steps"] = section(rows, world_size)
    header["failures"] = list(header.get("failures") or []) + list(failures)
    write_json(Path(out) / "profile.json", json_safe(header))
    return header


def add_collective_kernels(out: Path, header: dict, section: dict) -> dict:
    """Add the collective kernels' `section` (agoq.formats.collective_kernels.section) to a written profile,
    replacing any before (an additive section: the schema stays). Returns the header."""
    from agoq.formats.collective_kernels import NAME, kernel_rows

    header = {**header, NAME: section}
    kernel_rows(header, "collective_kernels")  # checked before it is written
    write_json(Path(out) / "profile.json", json_safe(header))
    return header
