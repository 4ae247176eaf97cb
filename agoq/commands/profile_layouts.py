"""The layout steps `agoq profile` measures: when its world has several ranks (--world-size N, or torchrun), a
real training step of each data-parallel layout the search prices, every rank running it, at the profile's
micro-batch and sequence length, every layer kept whole (bf16), the fused 8-bit AdamW over float32 masters (the
search's base knobs), one micro-batch per step, in the profile's own compile mode:

  replicated  DDP with bf16 gradients; DDP with QuanGrad's 8-bit gradients (quangrad8)
  fsdp        FSDP2 with bf16 gradients; FSDP2 with agoq's TLq-HS reduce-scatter (sdp4bit), with its own bf16
              weight all-gather and with agoq's int8 and int4 ones (`agoq train --weight-gather int8 / int4`; the
              int4 one with TLq-HS is what replaced agoq's retired own sharded step)

Each is `warmup` steps, then `steps` measured ones, run by `agoq train`'s own code
(agoq.train.measure.measure_steps with the process group): its step time is the median of the measured steps on
each rank, the largest over ranks; its peak the largest of any step on any rank (agoq.formats.layout_steps). The
search calibrates each layout's exposed communication and per-rank peak on them (agoq.search.layout_calibration).
A layout that fails (out of memory, a collective the backend lacks) is listed in the profile's failures.

On one rank (no --world-size, not torchrun), the fsdp kinds only, in this process, in a process group of one
(NCCL on the GPU, gloo on the CPU, on an in-memory store: no port) made for them and destroyed after: one-rank
FSDP2, FSDP2 in a group of one process (agoq.layout.ParallelLayout.one_rank, which only
this module sets; `agoq train` refuses fsdp in one process). It moves nothing between ranks, so its step less the
one-process step is FSDP2's own cost: the copies in and out of every unit's all-gather and reduce-scatter, its hooks,
the int8/int4 weight gathers' quantize and dequantize kernels (TLq-HS's reduce-scatter of one rank returns the
gradient unquantized, agoq.runtime.comm.sdp4bit.tlq_hs: its kernels are not in it). A what-if re-targeted from the
profile to N ranks carries it into its fsdp prices (agoq.search.layout_calibration); the one-GPU profile's own plans
do not use it (DDP of one process is no DDP, and fsdp needs several ranks).

With --world-size N the steps run in N spawned local processes (NCCL, one GPU each, or gloo on the CPU), as the
collectives are timed (agoq.profiler.collectives); under torchrun on the launched group, every rank calling
`measure_on_group`. With a `journal`, each layout measured (or failed) is appended to it as one JSON line the moment
it is done, beside the request it was measured for; `agoq profile --resume` reads it back and measures only the
rest (as agoq.commands.profile_steps does for the one-rank steps).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Callable, Optional

from agoq.vocabulary import DDP, FSDP

JOURNAL_NAME = "layout_steps.journal.jsonl"  # in the profile folder, while the layout steps are taken
STOPPED = "layout steps stopped"  # a failure's `what` where the processes died: the journal is kept for --resume
WARMUP_STEPS = 3
MEASURED_STEPS = 6
LAYOUTS = (  # (layout, gradients, weight gather): the module docstring's, in the order they are measured
    ("replicated", "bf16", "bf16"), ("replicated", "quangrad8", "bf16"),
    ("fsdp", "bf16", "bf16"), ("fsdp", "sdp4bit", "bf16"), ("fsdp", "sdp4bit", "int8"),
    ("fsdp", "sdp4bit", "int4"))
PARALLEL = {"replicated": DDP, "fsdp": FSDP}  # `agoq train --parallel` of each layout


def layout_kinds(micro_batch: int, compile_mode: str, world_size: int = 2) -> list[dict]:
    """The configurations of the module docstring (agoq.formats.layout_steps KEY_FIELDS), in measuring order; at
    `world_size` 1 the fsdp ones only (one-rank FSDP2: DDP of one process is no DDP)."""
    return [{"layout": layout, "gradients": gradients, "weight_gather": gather, "compile": compile_mode,
             "micro_batch": int(micro_batch), "grad_accum": 1, "optimizer": "adamw8bit", "master": "fp32"}
            for layout, gradients, gather in LAYOUTS if world_size > 1 or layout == "fsdp"]


def layout_train_settings(kind: dict, model: str, seq_len: int, dtype: str, device: str, steps: int,
                          seed: int) -> dict:
    """`agoq train`'s settings (agoq.train.config.TrainConfig keywords) that run one layout's step for `steps`
    steps."""
    return dict(model=model, device=device, dtype=dtype, seq_len=seq_len, micro_batch=kind["micro_batch"],
                grad_accum=kind["grad_accum"], gradients=kind["gradients"], optimizer=kind["optimizer"],
                master=kind["master"], compile=kind["compile"] == "compiled", parallel=PARALLEL[kind["layout"]],
                weight_gather=kind["weight_gather"], steps=steps, warmup=1, seed=seed, checkpoint_every=0,
                quiet=True)


def describe(kind: dict) -> str:
    gather = f", weight gather {kind['weight_gather']}" if kind["weight_gather"] != "bf16" else ""
    return (f"{kind['layout']} {kind['compile']} step, gradients {kind['gradients']}{gather}, micro-batch "
            f"{kind['micro_batch']} x {kind['grad_accum']}")


def _group_device(backend: str):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def measure_on_group(kinds: list[dict], *, model: str, seq_len: int, dtype: str, device: str, seed: int,
                     warmup: int = WARMUP_STEPS, steps: int = MEASURED_STEPS, measure: Optional[Callable] = None,
                     done: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Measure every kind on the default process group (every rank calls it with the same arguments); returns one
    entry per kind, the same on every rank: {"kind", "row"} (an agoq.formats.layout_steps row) or {"kind",
    "error"}. `measure(TrainConfig, World) -> StepFigures` is agoq.train.measure.measure_steps unless given;
    `done(entry)` is called on rank 0 as each kind is done (the journal)."""
    import torch
    import torch.distributed as dist

    from agoq.train import collector
    from agoq.train.config import TrainConfig
    from agoq.train.parallel import join_world

    if measure is None:
        from agoq.train.measure import measure_steps as measure
    world = join_world(device)
    where = _group_device(dist.get_backend())
    out = []
    with collector.hold():  # one full collection per layout, not three (agoq.train.collector)
        for kind in kinds:
            settings = layout_train_settings(kind, model, seq_len, dtype, device, warmup + steps, seed)
            error, figures = None, None
            try:
                cfg = TrainConfig(**settings)
                figures = measure(cfg.one_rank_fsdp() if world.size == 1 else cfg, world)
                measured = list(figures.seconds[warmup:]) or list(figures.seconds)
                mine = [1.0, statistics.median(measured), float(figures.max_peak_bytes or 0)]
            except Exception as e:  # noqa: BLE001 - one layout failing (out of memory, ...) keeps the rest
                error = f"{type(e).__name__}: {e}"[:500]
                mine = [0.0, 0.0, 0.0]
            ok = torch.tensor([mine[0]], dtype=torch.float64, device=where)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            largest = torch.tensor(mine[1:], dtype=torch.float64, device=where)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            if float(ok) < 1:
                entry = {"kind": kind, "error": error or "failed on another rank"}
            else:
                entry = {"kind": kind, "row": {
                    **kind, "policy": "bf16", "warmup_steps": warmup, "steps": steps,
                    "step_seconds": float(largest[0]),
                    "peak_bytes": int(largest[1]) if figures.peak_bytes is not None else None,
                    "seconds_per_step": [float(t) for t in figures.seconds], "source": "profile"}}
            out.append(entry)
            if done is not None and dist.get_rank() == 0:
                done(entry)
    return out


def _measure_rank(rank: int, kinds: list[dict], settings: dict, journal: Optional[str], request: dict,
                  use_cuda: bool) -> dict:
    """One rank's part of `spawn_on_group` (agoq.profiler.local_group runs it in the joined group)."""
    done = (lambda entry: _append(Path(journal), {"request": request, **entry})) if journal else None
    device = f"cuda:{rank}" if use_cuda else "cpu"
    return {"entries": measure_on_group(kinds, **{**settings, "device": device}, done=done)}


def one_rank_here(kinds: list[dict], settings: dict, journal: Optional[Path] = None,
                  request: Optional[dict] = None) -> list[dict]:
    """Run `measure_on_group` in this process on a process group of one: the group in place if there is one of one
    rank, else one made on an in-memory store (NCCL on the GPU, gloo on the CPU) and destroyed after. A spawned
    process paid its start, its imports and a cold compiler: on one H100 the probe's one-rank layout steps took
    30.9-32.8 s spawned, 12.1-12.3 s here (experiments/results/profile_time_*h100*.json). RuntimeError inside a
    group of several ranks (their steps are `spawn_on_group`'s or torchrun's)."""
    import torch.distributed as dist

    done = (lambda entry: _append(journal, {"request": request or {}, **entry})) if journal else None
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"one-rank layout steps inside a group of {dist.get_world_size()} ranks")
        return measure_on_group(kinds, **settings, done=done)
    use_cuda = str(settings.get("device", "")).startswith("cuda")
    dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return measure_on_group(kinds, **settings, done=done)
    finally:
        dist.destroy_process_group()


def spawn_on_group(world_size: int, kinds: list[dict], settings: dict, journal: Optional[Path] = None,
                   request: Optional[dict] = None, use_cuda: Optional[bool] = None) -> list[dict]:
    """Run `measure_on_group` in `world_size` spawned local processes (NCCL, one GPU each, or gloo on the CPU);
    returns rank 0's entries. RuntimeError when rank 0 left none."""
    from agoq.profiler.local_group import run_on_local_group  # agoq.profiler imports torch: not at start-up

    if use_cuda is None:
        use_cuda = str(settings.get("device", "")).startswith("cuda")
    result = run_on_local_group(_measure_rank, (kinds, settings, str(journal) if journal else None, request or {},
                                                use_cuda), world_size, use_cuda, "layout steps")
    return result["entries"]


def _append(journal: Path, entry: dict) -> None:
    with open(journal, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_journal(journal: Optional[Path], request: dict, kinds: list[dict]) -> dict[int, dict]:
    """{kind index: entry} of `journal`'s lines measured for `request`; other requests' lines and a last line cut
    short by a stop are skipped."""
    found: dict[int, dict] = {}
    if journal is None or not journal.is_file():
        return found
    for line in journal.read_text().splitlines():
        try:
            entry = json.loads(line)
            if entry.get("request") != request or entry.get("kind") not in kinds:
                continue
            if "row" not in entry and "error" not in entry:
                continue
            found[kinds.index(entry["kind"])] = {k: entry[k] for k in ("kind", "row", "error") if k in entry}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def model_spec(model: str, layers: Optional[int], folder: str) -> str:
    """`model`, or with `layers` a config.json in `folder` of that many decoder layers (the profiled model)."""
    if layers is None:
        return model
    from agoq.models import resolve_config

    config = resolve_config(model).to_dict()
    config["num_hidden_layers"] = layers
    spec = str(Path(folder) / "model.json")
    Path(spec).write_text(json.dumps(config))
    return spec


def request_of(model: str, layers: Optional[int], seq_len: int, micro_batch: int, dtype: str, compile_mode: str,
               world_size: int, seed: int, warmup: int, steps: int) -> dict:
    """What the layout steps were measured for (a journal line of another request is not reused)."""
    return {"model": model, "layers": layers, "seq_len": seq_len, "micro_batch": micro_batch, "dtype": dtype,
            "compile": compile_mode, "world_size": world_size, "seed": seed, "warmup": warmup, "steps": steps}


def rows_and_failures(entries: list[dict]) -> tuple[list[dict], list[dict]]:
    """(layout_steps rows, profile failures) of measured entries."""
    rows = [e["row"] for e in entries if "row" in e]
    failures = [{"what": f"layout step {describe(e['kind'])}", "error": e["error"]} for e in entries if "error" in e]
    return rows, failures


def measure_layout_steps(world_size: int, *, model: str, layers: Optional[int], seq_len: int, micro_batch: int,
                         dtype: str, device: str, compile_mode: str, seed: int = 0, warmup: int = WARMUP_STEPS,
                         steps: int = MEASURED_STEPS, journal: Optional[Path] = None,
                         say: Callable[[str], None] = lambda text: None) -> tuple[list[dict], list[dict]]:
    """Measure the layouts of `layout_kinds` in `world_size` spawned local processes (one: in this process; module
    docstring), those in `journal` for this request kept; returns (layout_steps rows, failures). Where the processes
    die or cannot start, the rows they journaled are returned with a failure whose `what` begins with STOPPED."""
    kinds = layout_kinds(micro_batch, compile_mode, world_size)
    request = request_of(model, layers, seq_len, micro_batch, dtype, compile_mode, world_size, seed, warmup, steps)
    found = read_journal(journal, request, kinds)
    todo = [k for i, k in enumerate(kinds) if i not in found]
    stopped = []
    if todo:
        where = (f"over {world_size} local processes" if world_size > 1 else
                 "in this process (one-rank FSDP2: its own cost)")
        say(f"layout steps: {len(todo)} layout(s) {where}, {warmup} warm-up + {steps} measured steps each")
        with tempfile.TemporaryDirectory(prefix="agoq-layout-steps-") as tmp:
            settings = dict(model=model_spec(model, layers, tmp), seq_len=seq_len, dtype=dtype, device=device,
                            seed=seed, warmup=warmup, steps=steps)
            try:
                entries = (one_rank_here(todo, settings, journal, request) if world_size == 1 else
                           spawn_on_group(world_size, todo, settings, journal, request,
                                          use_cuda=device.startswith("cuda")))
                for entry in entries:
                    found[kinds.index(entry["kind"])] = entry
            except (RuntimeError, ValueError) as e:  # the processes died or could not start: what they journaled
                found.update(read_journal(journal, request, kinds))  # before stands
                stopped.append({"what": f"{STOPPED} world_size={world_size}", "error": str(e)[-500:]})
    rows, failures = rows_and_failures([found[i] for i in sorted(found)])
    return rows, failures + stopped


def measure_layout_steps_torchrun(*, model: str, layers: Optional[int], seq_len: int, micro_batch: int, dtype: str,
                                  device: str, compile_mode: str, seed: int = 0, warmup: int = WARMUP_STEPS,
                                  steps: int = MEASURED_STEPS,
                                  journal: Optional[Path] = None) -> tuple[list[dict], list[dict]]:
    """As measure_layout_steps, on the group torchrun launched (every rank calls it; rank 0 reads and writes the
    journal and tells the others what is left)."""
    import torch.distributed as dist

    world_size, rank = dist.get_world_size(), dist.get_rank()
    kinds = layout_kinds(micro_batch, compile_mode)
    request = request_of(model, layers, seq_len, micro_batch, dtype, compile_mode, world_size, seed, warmup, steps)
    found = [read_journal(journal, request, kinds) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    found = {int(i): e for i, e in found[0].items()}
    todo = [k for i, k in enumerate(kinds) if i not in found]
    done = (lambda entry: _append(journal, {"request": request, **entry})) if journal is not None else None
    with tempfile.TemporaryDirectory(prefix="agoq-layout-steps-") as tmp:
        entries = measure_on_group(todo, model=model_spec(model, layers, tmp), seq_len=seq_len, dtype=dtype,
                                   device=device, seed=seed, warmup=warmup, steps=steps, done=done)
    for entry in entries:
        found[kinds.index(entry["kind"])] = entry
    return rows_and_failures([found[i] for i in sorted(found)])


__all__ = ["layout_kinds", "layout_train_settings", "measure_on_group", "measure_layout_steps",
           "measure_layout_steps_torchrun", "one_rank_here", "JOURNAL_NAME", "STOPPED", "LAYOUTS", "WARMUP_STEPS",
           "MEASURED_STEPS"]
