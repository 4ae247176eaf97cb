"""`agoq profile`'s collective-kernels stage: the quantized collectives' own kernels timed in this process
(agoq.profiler.collective_kernels) at three message sizes spanning the model's FSDP2 units (one decoder layer, the
root unit), written to profile.json `collective_kernels` (agoq.formats.collective_kernels). Rank 0 runs it (under
torchrun too); `--resume` of a profile without the section, or with an older version of it (which lacks a path this
agoq times), adds it; of one with it keeps it.
"""

from __future__ import annotations

from pathlib import Path


def unit_values(header: dict) -> tuple[int, int]:
    """(one decoder layer's values, the root unit's values) of the profiled model, from its config and parameter
    count (the model's config counts as agoq.models does); where the config gives none, the profile's weights split
    evenly over its layers and a root of the same size."""
    from agoq.models.config import unit_values as model_unit_values

    model = header.get("model") or {}
    layers = max(1, int(model.get("num_layers") or 1))
    try:
        layer, root = model_unit_values(model.get("config") or {}, int(model.get("parameters") or 0), layers)
        return max(1, layer), max(1, root)
    except (ValueError, TypeError, NotImplementedError, AttributeError):
        weights = int((header.get("memory") or {}).get("weights_bytes") or 0) // 2 or 1 << 16
        return max(1, weights // (layers + 1)), max(1, weights // (layers + 1))


def collective_kernels_stage(out: Path, header: dict, device: str, resume: bool, quiet: bool, say) -> dict:
    """Time the collective kernels and add them to the profile in `out` (unless --resume found them there);
    returns the header. A failure is recorded in the profile's `failures`, not raised: the profile stays usable."""
    import sys

    import torch

    from agoq.files import json_safe, write_json
    from agoq.formats.collective_kernels import NAME, VERSIONS, section
    from agoq.formats.profile import add_collective_kernels
    from agoq.profiler.collective_kernels import NODE_SIZE, WORLD, message_sizes, time_collective_kernels

    kept = header.get(NAME)
    if resume and kept:
        version = kept.get("version") if isinstance(kept, dict) else None
        if version == VERSIONS[-1]:
            say(f"--resume: the collective kernels in {out / 'profile.json'} are kept")
            return header
        say(f"--resume: the collective kernels in {out / 'profile.json'} are of version {version}, without every "
            f"path this agoq times: timed again")
    cuda = device.startswith("cuda")
    repeats = 10 if cuda else 3
    sizes = message_sizes(*unit_values(header))
    say(f"collective kernels: the quantized collectives' quantize / Hadamard / dequantize kernels of {WORLD} ranks "
        f"in one process, at {', '.join(f'{s / 2**20:.3g} MiB' for s in sizes)} (float32), median of {repeats}")
    try:
        rows = time_collective_kernels(sizes, device, repeats, progress=not quiet)
    except (RuntimeError, ValueError) as e:
        print(f"warning: the collective kernels could not be timed ({e}); a what-if from this profile prices the "
              "quantized collectives by their wire time only", file=sys.stderr)
        header = {**header, "failures": list(header.get("failures") or [])
                  + [{"what": "collective kernels", "error": str(e)}]}
        write_json(Path(out) / "profile.json", json_safe(header))
        return header
    name = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu"
    return add_collective_kernels(out, header, section(rows, WORLD, NODE_SIZE, name, repeats))


__all__ = ["collective_kernels_stage", "unit_values"]
