"""Making a Profile folder (docs/formats.md): every measurement of one model, written atomically.

`make_profile(settings, out_dir)` measures and writes DIR/profile.json, DIR/profile.parquet (and
DIR/collectives.parquet with a process group); `agoq.formats.profile.load_profile(dir)` reads them back.
A measurement that fails (an OOM, an exception) is listed in profile.json "failures" and the profile
goes on; an option whose sensitivity could not be measured is left out of profile.parquet, so no
later stage can pick it unmeasured.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from agoq.runtime.activations.policy import KINDS, split_layers
from agoq.runtime.activations.saved_bytes import find_decoder_layers
from agoq.environment import hardware, software_versions
from agoq.formats.profile import SCHEMA, load_profile, write_profile_files
from agoq.profiler.host_link import measure_host_link
from agoq.profiler.kernel_time import (
    attention_rerun_time,
    layer_forward_seconds,
    quantize_times,
    recompute_time,
)
from agoq.profiler.memory import memory_section
from agoq.profiler.model_source import (
    layer_shape,
    load_model,
    model_config_dict,
    model_name,
    token_batches,
    vocab_size,
)
from agoq.profiler.options import (
    check_bits_formats,
    kind_options,
    kind_shapes,
    option_bytes,
    shape_text,
)
from agoq.profiler.replay import REPLAYABLE
from agoq.profiler.sensitivity import Measurement, SensitivityMeter, measure_chunk
from agoq.profiler.tensor_error import measure_tensor_errors, sqnr_db
from agoq.progress import progress_bar
from agoq.schedules import in_flight


@dataclass
class ProfileSettings:
    """What to profile and how (see `agoq profile --help` for each field's meaning and unit)."""

    spec: str
    seq_len: int = 128
    micro_batch: int = 2
    dtype: str = "bf16"
    device: str = "cpu"
    bits: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6, 8])
    formats: list[str] = field(default_factory=lambda: ["int", "nf4"])
    block: int = 128
    batches: int = 2
    seed: int = 0
    layers: int | None = None
    pipeline_stages: int = 1
    micro_batches: int = 1
    world_size: int = 1
    budget_bytes: int | None = None
    ray_address: str | None = None  # None: no Ray; "local": a new local Ray; else a cluster address
    collective_sizes: list[int] | None = None
    timing_repeats: int | None = None  # None: 5 on CUDA, 1 on the CPU
    sensitivity_method: str = "replay"  # or "policy": a full forward + backward per option


def settings_record(settings: ProfileSettings) -> dict:
    """profile.json's "settings" section of `settings`."""
    return {"seq_len": settings.seq_len, "micro_batch": settings.micro_batch, "dtype": settings.dtype,
            "device": settings.device, "bits": list(settings.bits), "formats": list(settings.formats),
            "block": settings.block, "batches": settings.batches, "seed": settings.seed,
            "pipeline_stages": settings.pipeline_stages, "micro_batches": settings.micro_batches,
            "world_size": settings.world_size, "budget_bytes": settings.budget_bytes,
            "layers": settings.layers, "ray": settings.ray_address,
            "sensitivity_method": settings.sensitivity_method}


# the settings a resumed profile must share with the one it continues (not the plan's budget, nor where Ray runs)
RESUME_SETTINGS = ("seq_len", "micro_batch", "dtype", "device", "bits", "formats", "block", "batches", "seed",
                   "pipeline_stages", "micro_batches", "world_size", "layers", "sensitivity_method")


def resumable_header(out: Path, settings: ProfileSettings) -> dict | None:
    """The header of the profile in folder `out` that `agoq profile --resume` continues: None when there is none yet;
    raises ValueError naming what differs when it was made for another model or other settings."""
    if not (Path(out) / "profile.json").is_file():
        return None
    header = load_profile(out).header
    theirs, mine = dict(header.get("settings") or {}), settings_record(settings)
    theirs["model"], mine["model"] = (header.get("model") or {}).get("spec"), settings.spec
    # the steps go on being measured here: on another kind of device they would price plans for neither
    theirs["hardware"] = (header.get("hardware") or {}).get("name")
    mine["hardware"] = hardware(settings.device, 1)["name"]
    differ = [k for k in ("model", "hardware", *RESUME_SETTINGS) if theirs.get(k) != mine.get(k)]
    if differ:
        raise ValueError(f"--resume: {out} holds a profile made with other settings ("
                         + "; ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} now" for k in differ)
                         + "): give the flags it was made with, or profile into another folder without --resume")
    return header


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:500]


class _Progress:
    """A tqdm bar on stderr, or nothing."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar = enabled, None

    def start(self, total: int, desc: str) -> None:
        if self.enabled:
            self.close()
            self.bar = progress_bar(total=total, desc=desc, unit="run")

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _measure_sensitivities(settings: ProfileSettings, model, batches, measurements: list[Measurement],
                           progress: _Progress, say, notes: dict) -> list[dict]:
    if settings.ray_address is None:
        meter = SensitivityMeter(model, batches, settings.block)
        return measure_chunk(meter, measurements, progress.update, method=settings.sensitivity_method, notes=notes)
    from agoq.profiler.ray_tasks import ray_measure

    job = {"spec": settings.spec, "dtype": settings.dtype, "device": settings.device, "seed": settings.seed,
           "batches": settings.batches, "micro_batch": settings.micro_batch, "seq_len": settings.seq_len,
           "block": settings.block, "layers": settings.layers, "method": settings.sensitivity_method}
    by_layer: dict[int, list[dict]] = {}
    for m in measurements:
        by_layer.setdefault(m.layer, []).append(asdict(m))
    address = None if settings.ray_address == "local" else settings.ray_address
    say(f"sensitivity: {len(by_layer)} Ray tasks (one per layer) on {address or 'a local Ray'}")
    return ray_measure(job, list(by_layer.values()), address, progress.update)


class _Laps:
    """Seconds per phase of making a profile: lap(name) records the seconds since the previous lap (or the start)."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now

    def total(self) -> dict[str, float]:
        """The phases' seconds and "total", the seconds since the start."""
        self.seconds["total"] = time.perf_counter() - self.started
        return self.seconds


def _load(settings: ProfileSettings, device: torch.device):
    """(model, its decoder layers' count, the layer's tensor shapes at micro-batch x seq_len, the token batches, the
    options {kind: [options]} of --bits and --formats); ValueError for a --seq-len beyond the model's positions."""
    model = load_model(settings.spec, dtype=settings.dtype, device=settings.device, seed=settings.seed,
                       num_layers=settings.layers)
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_pos is not None and settings.seq_len > max_pos:
        raise ValueError(f"--seq-len {settings.seq_len} exceeds the model's max_position_embeddings ({max_pos})")
    num_layers = len(find_decoder_layers(model))
    shape = layer_shape(model, settings.micro_batch, settings.seq_len)
    batches = token_batches(vocab_size(model), settings.batches, settings.micro_batch, settings.seq_len,
                            settings.seed, device)
    options = {k: kind_options(k, settings.bits, settings.formats) for k in KINDS}
    return model, num_layers, shape, batches, options


def _tensor_errors(model, batches, options: dict, block: int, failures: list) -> dict:
    """The quantization error of each (layer, kind, option, format) on the tensors LAAQ keeps ({} where it failed)."""
    try:
        return measure_tensor_errors(model, batches, options, block)
    except Exception as e:  # noqa: BLE001
        failures.append({"what": "tensor quantization errors", "error": _short(e)})
        return {}


def _kernel_times(model, shape, options: dict, block: int, device: torch.device, repeats: int, bar: _Progress,
                  failures: list) -> dict:
    """{(kind, option, format): (quantize s, dequantize s, rerun s)}, measured once per (kind, option) since every
    layer has the same shapes: a quantized option's kernels (and, for attention, the attention forward its backward
    reruns; NaN otherwise), a recompute option's rerun only (NaN, NaN, s). Failures are listed and left out."""
    times: dict[tuple[str, str, str], tuple[float, float, float]] = {}
    per_kind = [(k, o) for k in KINDS for o in options[k] if o.option != "16"]
    bar.start(len(per_kind), "kernel times")
    for kind, opt in per_kind:
        nan = math.nan
        try:
            if opt.quantized:
                dtype = next(model.parameters()).dtype
                q, d = quantize_times(kind_shapes(shape, kind), opt, block, dtype, device, repeats)
                rerun = nan
                if kind == "attention":  # quantized q, k, v: backward reruns the attention forward
                    rerun = attention_rerun_time(kind_shapes(shape, kind), dtype, device, repeats)
                times[(kind, opt.option, opt.format)] = (q, d, rerun)
            else:
                r = recompute_time(kind, kind_shapes(shape, kind), next(model.parameters()).dtype, device, repeats)
                times[(kind, opt.option, opt.format)] = (nan, nan, r)
        except Exception as e:  # noqa: BLE001
            failures.append({"what": f"kernel time kind={kind} option={opt.label}", "error": _short(e)})
        bar.update()
    bar.close()
    return times


def _step_timing(model, batch, device: torch.device, repeats: int, laps: _Laps, failures: list) -> dict:
    """profile.json "timing": each layer's forward seconds, and on CUDA the host link (pinned copies each way under
    compute, for pricing activation offload); laps "kernel_times" and, on CUDA, "host_link"."""
    timing: dict = {}
    try:
        timing["layer_forward_seconds"] = layer_forward_seconds(model, batch, repeats)
    except Exception as e:  # noqa: BLE001
        failures.append({"what": "layer forward times", "error": _short(e)})
    laps.lap("kernel_times")
    if device.type == "cuda":
        try:
            timing["host_link"] = measure_host_link(device)
        except Exception as e:  # noqa: BLE001
            failures.append({"what": "host link", "error": _short(e)})
        laps.lap("host_link")
    return timing


def _table_rows(measurements: list[Measurement], results: list[dict], options: dict, shape, errors: dict,
                times: dict, block: int, failures: list) -> list[dict]:
    """profile.parquet's rows, one per measured (layer, kind, option, format): bytes, tensor error, sensitivity and
    extra seconds per layer (quantize + dequantize + rerun for a quantized option, the rerun for recompute, 0 for
    16). A measurement without a sensitivity or a time is listed in `failures` and left out."""
    by_key = {(r["layer"], r["kind"], r["option"], r["format"]): r for r in results}
    rows = []
    for m in measurements:
        r = by_key.get((m.layer, m.kind, m.option, m.format))
        if r is None or "error" in r:
            failures.append({"what": m.describe(), "error": (r or {}).get("error", "not measured")})
            continue
        opt = next(o for o in options[m.kind] if o.option == m.option and o.format == m.format)
        nbytes, unshared = option_bytes(shape, m.kind, opt, block)
        q, d, rc = times.get((m.kind, m.option, m.format), (math.nan, math.nan, math.nan))
        if opt.option == "16":
            err, extra = 0.0, 0.0
        else:
            err = errors.get((m.layer, m.kind, m.option, m.format), 0.0 if not opt.quantized else math.nan)
            extra = (q + d + (rc if math.isfinite(rc) else 0.0)) if opt.quantized else rc
        if not math.isfinite(extra):
            failures.append({"what": m.describe(), "error": "its kernel or recompute time was not measured"})
            continue
        rows.append({"layer": m.layer, "kind": m.kind, "option": m.option, "bits": opt.bits, "format": opt.format,
                     "shape": shape_text(kind_shapes(shape, m.kind)), "bytes": nbytes, "bytes_unshared": unshared,
                     "bytes_measured": r.get("bytes_measured"), "quant_error": err,
                     "sqnr_db": sqnr_db(err) if math.isfinite(err) else math.nan, "sensitivity": r["sensitivity"],
                     "extra_seconds": extra, "quantize_seconds": q, "dequantize_seconds": d,
                     "recompute_seconds": rc})
    return rows


def _memory(model, shape, num_layers: int, batch, device: torch.device, failures: list) -> dict:
    """profile.json "memory": a real step in bf16 and agoq-paper (agoq.profiler.memory), measured with nothing of
    the sensitivity runs left allocated."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return memory_section(model, shape, num_layers, batch, failures=failures)


def _collectives(settings: ProfileSettings, device: torch.device, progress: bool, say, failures: list):
    """The collectives table's rows over settings.world_size local processes (agoq.profiler.collectives)."""
    from agoq.profiler.collectives import spawn_collectives

    say(f"collectives: {settings.world_size} local processes")
    try:
        collectives, coll_failures = spawn_collectives(settings.world_size, settings.collective_sizes,
                                                       use_cuda=device.type == "cuda", progress=progress)
        failures += coll_failures
        return collectives
    except Exception as e:  # noqa: BLE001
        failures.append({"what": f"collectives world_size={settings.world_size}", "error": _short(e)})
        return None


def make_profile(settings: ProfileSettings, out_dir: str | os.PathLike, progress: bool = True,
                 say=print) -> dict:
    """Measure the model of `settings` and write the Profile folder `out_dir`; returns profile.json's dict.

    In order: load the model, the tensor errors, the kernel and recompute times, the layer forward (and host link)
    times, the sensitivities, the memory of real steps and the collectives, each phase's seconds in "seconds"."""
    check_bits_formats(settings.bits, settings.formats)
    laps = _Laps()
    failures: list[dict] = []
    bar = _Progress(progress)
    device = torch.device(settings.device)
    model, num_layers, shape, batches, options = _load(settings, device)
    laps.lap("load")
    repeats = settings.timing_repeats or (5 if device.type == "cuda" else 1)

    say(f"profiling {model_name(settings.spec)}: {num_layers} layers, micro-batch {settings.micro_batch} x "
        f"{settings.seq_len} tokens, {settings.dtype} on {settings.device}")
    errors = _tensor_errors(model, batches, options, settings.block, failures)
    laps.lap("tensor_errors")
    times = _kernel_times(model, shape, options, settings.block, device, repeats, bar, failures)
    timing = _step_timing(model, batches[0], device, repeats, laps, failures)

    measurements = [Measurement(layer, k, o.option, o.format) for layer in range(num_layers) for k in KINDS
                    for o in options[k]]
    exact = settings.sensitivity_method == "replay"  # recompute: 0, not run (agoq.profiler.sensitivity.measure_chunk)
    runs = sum(1 for m in measurements if m.option != "16" and not (exact and m.option == "recompute"))
    say(f"sensitivity: {runs} measurements x {settings.batches} batches ({settings.sensitivity_method})")
    bar.start(len(measurements), "sensitivity")
    sensitivity_notes: dict = {}
    results = _measure_sensitivities(settings, model, batches, measurements, bar, say, sensitivity_notes)
    bar.close()
    laps.lap("sensitivity")
    rows = _table_rows(measurements, results, options, shape, errors, times, settings.block, failures)

    say("memory: a real step in bf16 and agoq-paper")
    memory = _memory(model, shape, num_layers, batches[0], device, failures)
    pipeline = pipeline_summary(settings.pipeline_stages, settings.micro_batches, num_layers)
    laps.lap("memory")
    collectives = None
    if settings.world_size > 1:
        collectives = _collectives(settings, device, progress, say, failures)
        laps.lap("collectives")

    replayed = sum(1 for m in measurements if settings.sensitivity_method == "replay" and m.kind in REPLAYABLE
                   and m.format in ("int", "nf4"))
    counts = {"sensitivity_runs": runs, "replayed": replayed, "policy_runs": runs - replayed,
              "batches": settings.batches}
    return write_profile(Path(out_dir), settings, model, num_layers, rows, memory, pipeline, failures, collectives,
                         extra={"seconds": laps.total(), "counts": counts, "sensitivity": sensitivity_notes,
                                "timing": timing})


def write_profile(out: Path, settings: ProfileSettings, model, num_layers: int, rows: list[dict], memory: dict,
                  pipeline: dict, failures: list[dict], collectives: list[dict] | None = None,
                  extra: dict | None = None) -> dict:
    """Write the Profile folder (agoq.formats.profile.write_profile_files): the table, the collectives and
    profile.json describing the model, the settings, this machine and the measurements; returns the header."""
    from agoq.models import fingerprint

    header = {
        "schema": SCHEMA,
        "model": {"spec": settings.spec, "name": model_name(settings.spec), "fingerprint": fingerprint(model),
                  "config": model_config_dict(model), "num_layers": num_layers,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())},
        "settings": settings_record(settings),
        "hardware": hardware(settings.device, torch.cuda.device_count() if settings.device.startswith("cuda")
                             else 1),
        "software": software_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "memory": memory,
        "pipeline": pipeline,
        "failures": failures,
        **(extra or {}),
    }
    return write_profile_files(out, header, rows, collectives)


def pipeline_summary(stages: int, micro_batches: int, num_layers: int, chunks: int = 2) -> dict:
    """The profile.json "pipeline" section: layer -> stage and in-flight counts per schedule."""
    counts = {"1f1b": in_flight(stages, micro_batches)}
    notes = []
    if stages > 1 and micro_batches % stages == 0 and num_layers >= stages * chunks:
        counts["interleaved-1f1b"] = in_flight(stages, micro_batches, chunks)
    elif stages == 1:
        counts["interleaved-1f1b"] = counts["1f1b"]
    else:
        notes.append(f"interleaved-1f1b left out: it needs micro-batches ({micro_batches}) a multiple of stages "
                     f"({stages}) and at least {stages * chunks} layers")
    out = {"stages": stages, "micro_batches": micro_batches, "layer_stage": split_layers(num_layers, stages),
           "in_flight": counts, "interleaved_chunks": chunks}
    if notes:
        out["notes"] = notes
    return out
