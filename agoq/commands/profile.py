"""Measure a model on this machine and write a Profile folder (docs/formats.md):

  DIR/profile.parquet   one row per (decoder layer, tensor kind, option): exact bytes kept for backward,
                        the tensor's own quantization error (relative L2, SQNR) on real batches,
                        sensitivity (relative L2 error of all weight gradients when only that layer and
                        kind uses the option, against the same LAAQ runtime keeping 16 bits), and the
                        quantize/dequantize or recompute time the option adds
  DIR/profile.json      model fingerprint, settings, hardware, versions, memory model (predicted vs
                        measured peak of a real bf16 and agoq-paper step), pipeline in-flight counts
                        (1F1B and interleaved 1F1B, simulated), failures, the quantized collectives' kernels
  DIR/collectives.parquet  with --world-size W or under torchrun: all-reduce / reduce-scatter /
                        all-gather times per message size for nccl-fp32, nccl-bf16, quangrad8, sdp4bit; and in
                        profile.json `layout_steps`: each data-parallel layout's real step on every rank (on one
                        rank: FSDP2's steps in one process, its own cost, which a what-if plan carries)
  DIR/plan.json         with --budget: a bit-width plan

MODEL is a preset (llama-tiny, probe, llama-3.2-1b, llama-3-8b; fresh weights, nothing downloaded), a
HuggingFace config.json (LLaMA, Mistral, Qwen2 families), or package.module:function returning an
nn.Module with LLaMA-style decoder layers.

A preset or config.json too big for the device is refused (exit 2) before it is built: weights, gradients, the
measured step's optimizer state and one sequence's layer inputs, counted from the config, against the device's
free memory (RAM on the CPU), in GB, with how many layers --layers could keep. An --out that holds a finished
profile or a training run is refused unless --force; --resume needs a profile in --out to continue.

examples:
  agoq profile llama-tiny                                   # CPU, seconds
  agoq profile probe --device cuda --out profiles/probe
  agoq profile llama-3-8b --layers 4 --seq-len 4096 --micro-batch 1 --batches 1
  agoq profile probe --world-size 2 --pipeline-stages 4 --micro-batches 8 --budget 30GiB
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from agoq.commands.profile_kernels import collective_kernels_stage
from agoq.commands.profile_layouts import JOURNAL_NAME as LAYOUT_JOURNAL_NAME
from agoq.commands.profile_steps import JOURNAL_NAME
from agoq.files import check_output_folder
from agoq.units import format_bytes

HELP = "measure a model on this hardware: bytes, error and sensitivity per layer and kind"


def _offload_layers(header: dict):
    """How many leading layers the offloading measured steps offload (agoq.commands.profile_steps): every layer but
    the last (one of a one-layer model) where the profile measured the host link, else None (no such steps)."""
    if not (header.get("timing") or {}).get("host_link"):
        return None
    layers = int(header["model"]["num_layers"])
    return max(1, layers - 1) if layers >= 1 else None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _str_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def _size_list(text: str) -> list[int]:
    from agoq.commands.arguments import size_bytes

    return [size_bytes(v) for v in _str_list(text)]


# what a training run leaves in its folder (agoq.formats.run, agoq.train.checkpoint): a profile is not written there
RUN_FILES = ("run.json", "metrics.jsonl", "checkpoints")
# a profile's files (agoq.formats.profile), profile.json first: without it the folder holds no complete profile
PROFILE_FILES = ("profile.json", "profile.parquet", "profile.csv", "collectives.parquet", "plan.json")


def _check_out_folder(out: Path, journal: Path, resume: bool, force: bool) -> None:
    """Refuse an --out this profile must not write into: with --resume one without a profile to continue;
    without it one holding a stopped profile's measured steps (only --resume continues them), and, unless
    --force, a finished profile (it would be replaced) or a training run's files."""
    made = (out / "profile.json").is_file()
    stopped = journal.is_file() and journal.stat().st_size > 0
    if resume:
        if not out.is_dir():
            raise ValueError(f"--resume: {out} does not exist, so there is no stopped profile to continue: drop "
                             "--resume to profile afresh, or give the --out of the profile to continue")
        if not made:
            raise ValueError(f"--resume: {out} holds no profile (no profile.json) to continue: drop --resume to "
                             "profile afresh, or give the --out of the profile to continue")
        return
    if stopped:
        raise ValueError(f"{out} holds the steps a stopped profile measured ({journal.name}): continue that profile "
                         f"with --resume and the flags it was made with, or delete {journal} (or give another "
                         "--out) to profile afresh")
    if force:
        return
    run_files = [name for name in RUN_FILES if (out / name).exists()]
    if run_files:
        raise ValueError(f"--out {out} holds a training run ({', '.join(run_files)}): give another --out for the "
                         "profile, or --force to write it beside the run's files")
    if made:
        raise ValueError(f"--out {out} already holds a profile (profile.json): give another --out, --resume to "
                         "continue it if it was stopped, or --force to replace it")


def _remove_profile(out: Path) -> None:
    """Remove the profile --force replaces, profile.json first, so that nothing of it is read with the new one
    (an old collectives.parquet or plan.json would otherwise stay beside a profile that did not make them)."""
    for name in PROFILE_FILES:
        (out / name).unlink(missing_ok=True)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `agoq profile`'s arguments to `parser` and set its function."""
    from agoq.commands.arguments import integer, non_negative_int, positive_int, request_field

    parser.add_argument("model", help="preset, HuggingFace config.json, or package.module:function")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per sequence (default: 4096 on CUDA, 64 on the CPU, at most the model's "
                             "max_position_embeddings)")
    parser.add_argument("--micro-batch", type=positive_int, default=2, help="sequences per micro-batch (default 2)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="model dtype (default: bf16 on CUDA, fp32 on the CPU, whose bf16 matmuls are slow)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="profile only the first N decoder layers of the model, at most its own number "
                             "(default: all)")
    parser.add_argument("--bits", type=_int_list, default=[2, 3, 4, 5, 6, 8],
                        help="bit widths to measure, 2..8 (default 2,3,4,5,6,8)")
    parser.add_argument("--formats", type=_str_list, default=["int", "nf4"],
                        help="quantization formats: int (symmetric absmax), nf4 (4-bit codebook) (default int,nf4)")
    parser.add_argument("--block", type=positive_int, default=128, help="values per quantization scale (default 128)")
    parser.add_argument("--batches", type=positive_int, default=2,
                        help="random token batches (fixed seeds) that errors and sensitivities average over "
                             "(default 2)")
    parser.add_argument("--sensitivity", choices=("replay", "policy"), default="replay",
                        help="how sensitivities are measured: replay (one forward per batch, then per option only the "
                             "backward below its layer with the tensor quantized, the same numbers; recompute options "
                             "0, exact) or policy (a full forward + backward per option's policy) (default replay)")
    parser.add_argument("--seed", type=integer, default=0, help="seed of the weights and batches (default 0)")
    parser.add_argument("--budget", type=request_field("budget"), default=None,
                        help="memory budget per GPU, e.g. 30GiB: also write DIR/plan.json")
    parser.add_argument("--pipeline-stages", type=positive_int, default=1, help="pipeline stages P (default 1)")
    parser.add_argument("--micro-batches", type=positive_int, default=None,
                        help="micro-batches per step M for the pipeline counts (default: 2 x stages; 1 without a pipeline)")
    parser.add_argument("--world-size", type=positive_int, default=1,
                        help="time collectives, and a real training step of each data-parallel layout (DDP bf16 "
                             "and quangrad8, FSDP2 bf16, TLq-HS and TLq-HS with the int8 and with the int4 weight "
                             "gather: the layout steps the search calibrates communication and per-rank peaks on), in "
                             "this many local processes (NCCL on GPUs, gloo on the CPU); under torchrun the launched "
                             "group is used (default 1: neither)")
    parser.add_argument("--collective-sizes", type=_size_list, default=None,
                        help="message sizes for collectives, e.g. 1MiB,64MiB (default 1MiB..1GiB by 4x on "
                             "GPUs, 16KiB,256KiB on the CPU)")
    parser.add_argument("--ray", action="store_true", help="spread sensitivity runs over a new local Ray")
    parser.add_argument("--ray-address", default=None,
                        help="spread sensitivity runs over this Ray cluster (e.g. auto or ray://host:10001); "
                             "default: no Ray")
    parser.add_argument("--out", default=None, help="output folder (default ./profiles/<model name>)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads for torch (default: 1 for a CPU profile of a model with hidden size "
                             "< 1024, whose small operations run fastest on one thread; else torch's default)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure the steps with each decoder layer torch.compile'd (every kind of step "
                             "below, and compile's activation_memory_budget 0.5 / 0.1): the search then prices "
                             "compiled plans and compile's own memory saver (default: on with a CUDA device, as "
                             "agoq train compiles there)")
    parser.add_argument("--measured-steps", type=non_negative_int, default=None, metavar="N",
                        help="training steps per kind of step measured with agoq train's own code, for the search "
                             "to price plans from: bf16, agoq-paper and checkpoint-all at every micro-batch dividing "
                             "--micro-batch with one and two micro-batches per step, QuanGrad's gradients, float32 "
                             "AdamW and no masters, and on a GPU agoq-paper with every layer but the last offloaded "
                             "to host memory (what offload is priced from) (agoq.commands.profile_steps); plans of a "
                             "kind not measured are not offered; also the steps measured of each layout step, after 3 "
                             "warm-up steps (1 on the CPU): with several ranks every layout's, with one the fsdp ones "
                             "in one process (FSDP2's own cost, for a what-if: agoq search --world-size N) "
                             "(agoq.commands.profile_layouts); 0: "
                             "none (default 6 on a GPU, 3 on the CPU)")
    parser.add_argument("--measured-repeats", type=positive_int, default=None, metavar="R",
                        help="measure each kind of step R times, each pass in the other order, and keep the least "
                             "median: a step is slowed, never sped up, by what else runs, and one slowed kind "
                             "misprices every plan priced from it (default: eager kinds 2 on a GPU, compiled kinds "
                             "once, whose passes agree within a few per cent; 1 on the CPU)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the profile in --out made with the same model and flags: keep its profile.json "
                             "and the measured steps already done (each is saved the moment it is measured, in "
                             f"{JOURNAL_NAME}), and measure only the rest; a profile stopped in its steps (a lost "
                             "machine, a time limit) loses at most the kind of step it was in. Without --resume a folder "
                             "holding a stopped profile's steps is refused rather than emptied, and a finished "
                             "profile is made again only with --force; --resume on a folder without a profile is "
                             "refused")
    parser.add_argument("--force", action="store_true",
                        help="profile into an --out that already holds a finished profile, replacing it (its "
                             "profile.json, table, collectives.parquet and plan.json are removed first), or a "
                             "training run's files (run.json, metrics.jsonl, checkpoints/: kept, the profile is "
                             "written beside them); without --force such a folder is refused (exit 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def _torchrun_collectives(args, device: str, layout_steps: Optional[dict]) -> tuple[int, tuple, Optional[tuple]]:
    """Collectives on the group torchrun launched, then (with `layout_steps`: measure_layout_steps_torchrun's
    keywords, its journal rank 0's) the layouts' multi-rank steps on it, unless rank 0 finds them complete in the
    profile --resume continues; returns (rank, (rows, failures) of the collectives, (rows, failures) of the layout
    steps or None)."""
    import datetime

    import torch
    import torch.distributed as dist

    from agoq.profiler.collectives import CPU_SIZES, GPU_SIZES, profile_collectives

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    sizes = args.collective_sizes or list(GPU_SIZES if cuda else CPU_SIZES)
    rows, failures = profile_collectives(sizes, 10 if cuda else 3, progress=not args.quiet)
    rank = dist.get_rank()
    layouts = None
    if layout_steps is not None:
        skip = [rank == 0 and _layout_steps_complete(args, layout_steps["journal"])]
        dist.broadcast_object_list(skip, src=0)
        if not skip[0]:
            from agoq.commands.profile_layouts import measure_layout_steps_torchrun

            layouts = measure_layout_steps_torchrun(**layout_steps)
    dist.destroy_process_group()
    return rank, (rows, failures), layouts


def _layout_steps_complete(args, journal: Path) -> bool:
    """Whether the profile --resume continues holds its layout steps, complete (no journal of them left)."""
    made = journal.parent / "profile.json"
    if not args.resume or journal.is_file() or not made.is_file():
        return False
    import json

    try:
        return "layout_steps" in json.loads(made.read_text())
    except ValueError:
        return False


def _layout_steps(out: Path, header: dict, args, world_size: int, layout_steps: dict,
                  measured: Optional[tuple], say) -> dict:
    """Add the layouts' steps (agoq.commands.profile_layouts) to the profile: those measured under torchrun
    (`measured`), or measured now in --world-size N local processes (N = 1: one-rank FSDP2's, the fsdp kinds in this
    process; not for a pipeline's profile, which no what-if re-targets), unless --resume found them complete
    or --measured-steps is 0; returns the header."""
    from agoq.formats.profile import add_layout_steps

    if measured is None:
        if (world_size == 1 and args.pipeline_stages > 1) or not layout_steps["steps"] \
                or _layout_steps_complete(args, layout_steps["journal"]):
            return header
        from agoq.commands.profile_layouts import measure_layout_steps

        measured = measure_layout_steps(world_size, say=say, **layout_steps)
        world = world_size
    else:
        world = int(header["settings"].get("world_size") or 0)
    if world < 1:
        return header
    header = add_layout_steps(out, header, *measured, world)
    from agoq.commands.profile_layouts import STOPPED

    stopped = [f for f in measured[1] if f["what"].startswith(STOPPED)]
    if stopped:  # the journal is kept: --resume measures the rest
        why = (stopped[0]["error"].strip().splitlines() or [""])[-1]
        print(f"warning: the layout steps stopped ({why}); the profile holds the {len(measured[0])} measured "
              f"before; `agoq profile ... --resume` with the same flags measures the rest", file=sys.stderr)
    else:
        layout_steps["journal"].unlink(missing_ok=True)
    return header


def _print_layout_steps(header: dict) -> None:
    """One line per measured layout step (agoq.formats.layout_steps): its step and its largest rank's peak."""
    from agoq.commands.profile_layouts import describe
    from agoq.formats.layout_steps import layout_rows

    rows = layout_rows(header)
    world = header.get("layout_steps", {}).get("world_size")
    if rows and world == 1:
        print("  layout steps in one process (one-rank FSDP2: its own cost, which a what-if plan for several ranks "
              "carries, agoq search --world-size N):")
    elif rows:
        print(f"  layout steps over {world} ranks (the search calibrates each layout's "
              "communication and peak per rank on them):")
    for row in rows:
        peak = f", peak {format_bytes(row['peak_bytes'])} on its largest rank" if row.get("peak_bytes") else ""
        print(f"    {describe(row)}: {row['step_seconds'] * 1e3:.1f} ms{peak}")


def _write_plan(out: Path, budget: int) -> str:
    """Search the profile just written for a plan within `budget` (the MILP of `agoq search`), write
    DIR/plan.json; returns a line saying so."""
    from agoq.search import InfeasibleBudget, plan_from_profile

    try:
        plan = plan_from_profile(str(out), budget)
    except ValueError as e:
        from agoq.commands.arguments import flag

        why = e.advice(flag) if isinstance(e, InfeasibleBudget) else str(e)
        raise ValueError(f"the profile is written to {out}, but no plan fits the budget: {why}") from None
    plan.save(out / "plan.json")
    return f"wrote {out / 'plan.json'} (agoq search, MILP, budget {format_bytes(budget)})"


def run(args: argparse.Namespace) -> int:
    """Entry point of `agoq profile`."""
    import torch

    from agoq.formats.profile import add_collectives, add_measured_steps, load_profile
    from agoq.models.size_check import check_spec_fits
    from agoq.profiler.model_source import check_layers, model_name
    from agoq.profiler.profile import ProfileSettings, make_profile, resumable_header
    from agoq.units import format_bytes

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    dtype = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    if args.ray and args.ray_address:
        raise ValueError("give either --ray (a new local Ray) or --ray-address ADDR, not both")
    micro_batches = args.micro_batches or (1 if args.pipeline_stages == 1 else 2 * args.pipeline_stages)
    check_layers(args.model, args.layers)
    out = check_output_folder(args.out or Path("profiles") / model_name(args.model), "--out")
    journal, layout_journal = out / JOURNAL_NAME, out / LAYOUT_JOURNAL_NAME
    for stopped in (journal, layout_journal):
        _check_out_folder(out, stopped, args.resume, args.force)

    from agoq.models import PRESETS, resolve_config

    seq_len = args.seq_len
    if seq_len is None:
        seq_len = 4096 if device.startswith("cuda") else 64
        if args.model in PRESETS:
            seq_len = min(seq_len, resolve_config(args.model).max_position_embeddings)
    steps = args.measured_steps if args.measured_steps is not None else (6 if device.startswith("cuda") else 3)
    compiled = args.compile if args.compile is not None else device.startswith("cuda")
    layout_steps = dict(model=args.model, layers=args.layers, seq_len=seq_len, micro_batch=args.micro_batch,
                        dtype=dtype, device=device, compile_mode="compiled" if compiled else "eager", seed=args.seed,
                        warmup=3 if device.startswith("cuda") else 1, steps=steps, journal=layout_journal)

    collectives_torchrun, layouts_measured = None, None
    if _under_torchrun():
        rank, collectives_torchrun, layouts_measured = _torchrun_collectives(args, device,
                                                                             layout_steps if steps else None)
        if rank != 0:
            return 0
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
    check_spec_fits(args.model, args.layers, device=device, dtype=dtype, seq_len=seq_len,
                    fewer_layers="--layers N to profile only the first N layers", optimizer="adamw8bit", master="fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device == "cpu" and args.model in PRESETS and resolve_config(args.model).hidden_size < 1024:
        torch.set_num_threads(1)
    settings = ProfileSettings(
        spec=args.model, seq_len=seq_len, micro_batch=args.micro_batch, dtype=dtype, device=device,
        bits=args.bits, formats=args.formats, block=args.block, batches=args.batches, seed=args.seed,
        layers=args.layers, pipeline_stages=args.pipeline_stages, micro_batches=micro_batches,
        world_size=1 if collectives_torchrun else args.world_size, budget_bytes=args.budget,
        ray_address="local" if args.ray else args.ray_address, collective_sizes=args.collective_sizes,
        sensitivity_method=args.sensitivity)
    say = (lambda *a: None) if args.quiet else (lambda text: print(text, file=sys.stderr))
    header = resumable_header(out, settings) if args.resume else None
    complete = header is not None and "measured_steps" in header and not journal.is_file()
    if header is None:
        journal.unlink(missing_ok=True)  # empty, or left without the profile it belonged to
        if args.force and (out / "profile.json").is_file():
            _remove_profile(out)
        header = make_profile(settings, out, progress=not args.quiet, say=say)
    else:
        say(f"--resume: {out / 'profile.json'} (made {header.get('date')}) is kept; "
            + ("its measured steps are complete" if complete else f"measured steps already in {journal.name} are kept"))
    if collectives_torchrun is not None:
        header = add_collectives(out, header, *collectives_torchrun)
    if steps and not complete:
        from agoq.commands.profile_steps import measure_profile_steps

        modes = ["eager"] + (["compiled"] if compiled else [])
        repeats = args.measured_repeats or (2 if device.startswith("cuda") else 1)
        compiled_repeats = args.measured_repeats or 1  # agoq.commands.profile_steps: compiled kinds agree in one
        say(f"measured steps: {steps} steps of each kind the search prices plans from ({', '.join(modes)}), "
            f"{repeats} pass{'es' if repeats > 1 else ''}"
            + (f" (compiled: {compiled_repeats})" if compiled and compiled_repeats != repeats else ""))
        rows, failures, notes = measure_profile_steps(args.model, layers=args.layers, seq_len=seq_len,
                                                      micro_batch=args.micro_batch, dtype=dtype, device=device,
                                                      compile_modes=modes, steps=steps, seed=args.seed,
                                                      repeats=repeats, compiled_repeats=compiled_repeats,
                                                      progress=not args.quiet,
                                                      offload_layers=_offload_layers(header), journal=journal)
        for note in notes:
            print(f"warning: measured step {note}", file=sys.stderr)
        header = add_measured_steps(out, header, rows, failures)
        journal.unlink(missing_ok=True)
    header = _layout_steps(out, header, args, settings.world_size, layout_steps, layouts_measured, say)
    header = collective_kernels_stage(out, header, device, args.resume, args.quiet, say)
    files = header["files"]
    print(f"wrote {out / 'profile.json'} and {out / files['table']}"
          + (f" and {out / files['collectives']}" if "collectives" in files else ""))
    if files["table"].endswith(".csv"):
        print("note: pyarrow is not installed, so the table was written as CSV instead of parquet")
    table = load_profile(out).table
    four = table[(table.bits == 4) & (table.format == "int")]
    if len(four):
        by_kind = four.groupby("kind").sensitivity.mean().sort_values(ascending=False)
        print("  sensitivity at 4 bits, mean over layers (gradient error with one layer's kind quantized): "
              + ", ".join(f"{k} {v:.2g}" for k, v in by_kind.items()))
    memory = header["memory"]
    for step in memory["steps"]:
        measured = step.get("measured_peak_bytes")
        pred = step.get("predicted_peak_bytes")
        text = f"  {step['policy']:>10s} step: predicted peak {format_bytes(pred) if pred is not None else '-'}"
        text += f", measured {format_bytes(measured)}" if measured else ", measured: not measured on this device"
        if step.get("relative_error") is not None:
            text += f" ({step['relative_error']:+.1%})"
        print(text)
    _print_layout_steps(header)
    pipe = header["pipeline"]
    if pipe["stages"] > 1:
        print(f"  pipeline {pipe['stages']} stages x {pipe['micro_batches']} micro-batches, in flight: "
              + ", ".join(f"{k} {v}" for k, v in pipe["in_flight"].items()))
    if header["failures"]:
        print(f"{len(header['failures'])} measurement(s) failed (listed in profile.json 'failures'); first: "
              f"{header['failures'][0]['what']}: {header['failures'][0]['error']}")
    if args.budget is not None:
        print(_write_plan(out, args.budget))
    return 0
