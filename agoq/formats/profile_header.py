"""The header of a Profile folder (profile.json, docs/formats.md "Profile"): its schema and the sections a reader
cannot do without, checked by `check_header`, which `agoq.formats.profile.load_profile` (the search's reader) and the
read-only view `agoq.formats.views.read_profile_header` (the dashboard's) both run. Light: no pandas, no kernels."""

from __future__ import annotations

import math

from agoq.formats.layout_steps import layout_rows
from agoq.formats.schema import FormatError, check_schema

PROFILE_SCHEMA_KIND = "agoq.profile"
PROFILE_SCHEMA_MAJOR = 1
# 1.1: the optional `layout_steps` section (agoq.formats.layout_steps); a 1.0 profile is read as one without it
PROFILE_SCHEMA_MINOR = 1
SCHEMA = f"{PROFILE_SCHEMA_KIND}/{PROFILE_SCHEMA_MAJOR}.{PROFILE_SCHEMA_MINOR}"


def check_header(header: dict, where: str) -> None:
    """Refuse a profile header (`where`: how to name its file) of another schema kind or a newer major version, one
    missing a required section (REQUIRED_SECTIONS) or one of their keys, or one with a malformed timing.host_link;
    FormatError naming the file and the field."""
    check_schema(header, PROFILE_SCHEMA_KIND, PROFILE_SCHEMA_MAJOR, where)
    _check_sections(header, where)
    _check_host_link(header, where)
    _check_files(header, where)
    for name in OPTIONAL_SECTIONS:
        value = header.get(name)
        if value is not None and not isinstance(value, dict):
            raise FormatError(f"{where}: {name}: must be an object or null, got {type(value).__name__}")
    try:
        layout_rows(header, where)
    except ValueError as e:
        raise FormatError(f"{e}; re-run `agoq profile` to measure them again") from None


OPTIONAL_SECTIONS = ("pipeline", "hardware", "software", "measured_steps", "layout_steps")  # objects where present


def _check_files(header: dict, where: str) -> None:
    """`files`, where present: {"table": NAME, "collectives": NAME}, each a plain file name in the profile's folder
    (a reader joins it onto the folder, so no name may lead out of it)."""
    files = header.get("files")
    if files is None:
        return
    if not isinstance(files, dict):
        raise FormatError(f"{where}: files: must be an object of file names, got {type(files).__name__}")
    for which, name in files.items():
        if name is not None and (not isinstance(name, str) or not name or "/" in name or "\\" in name
                                 or name in (".", "..")):
            raise FormatError(f"{where}: files.{which}: {name!r} is not a plain file name in the profile folder")


# the header's sections the search cannot do without, and the keys of each it reads with no default worth
# planning by: without `memory` the search would plan from nothing but the activations, without `settings` at
# another sequence length, micro-batch or dtype than measured (docs/formats.md)
REQUIRED_SECTIONS = {"model": ("fingerprint", "num_layers"), "settings": ("seq_len", "micro_batch", "dtype"),
                     "memory": ("weights_bytes",)}


def _check_sections(header: dict, where: str) -> None:
    """Refuse a header missing a required section (REQUIRED_SECTIONS) or one of its keys, naming the file and
    what is missing."""
    again = "re-run `agoq profile` to make the profile again (a profile.json written by agoq has it)"
    for section, keys in REQUIRED_SECTIONS.items():
        value = header.get(section)
        if value is None:
            raise FormatError(f"{where}: the {section!r} section is missing, which the search needs; {again}")
        if not isinstance(value, dict):
            raise FormatError(f"{where}: {section}: must be an object, got {type(value).__name__}; {again}")
        missing = [k for k in keys if k not in value]
        if missing:
            raise FormatError(f"{where}: {', '.join(f'{section}.{k}' for k in missing)}: missing, which the search "
                             f"needs; {again}")


HOST_LINK_RATES = ("d2h_bytes_per_second", "h2d_bytes_per_second")


def _check_host_link(header: dict, where: str) -> None:
    """timing.host_link, optional (absent or null: not measured): rates finite and > 0 bytes/s, bytes_per_copy an int
    > 0, compute_slowdown finite and >= 0, pinnable_bytes an int >= 0."""
    timing = header.get("timing")
    if timing is None:
        return
    if not isinstance(timing, dict):
        raise FormatError(f"{where}: timing: must be an object, got {type(timing).__name__}")
    link = timing.get("host_link")
    if link is None:
        return
    again = "re-run `agoq profile` on the GPU to measure the host link again"
    if not isinstance(link, dict):
        raise FormatError(f"{where}: timing.host_link: must be an object, got {type(link).__name__}; {again}")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def integer(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    checks = [(key, lambda v: number(v) and v > 0, "a finite number of bytes per second > 0")
              for key in HOST_LINK_RATES]
    checks += [("bytes_per_copy", lambda v: integer(v) and v > 0, "an integer number of bytes > 0"),
               ("compute_slowdown", lambda v: number(v) and v >= 0, "a finite ratio >= 0"),
               ("pinnable_bytes", lambda v: integer(v) and v >= 0, "an integer number of bytes >= 0")]
    for key, ok, what in checks:
        if key not in link or link[key] is None:
            got = "missing" if key not in link else "null (not a finite number when written)"
            raise FormatError(f"{where}: timing.host_link.{key}: {got}; must be {what}; {again}")
        if not ok(link[key]):
            raise FormatError(f"{where}: timing.host_link.{key}: must be {what}, got {link[key]!r}; {again}")
