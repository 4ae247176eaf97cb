"""Turn a profile and a memory budget into a plan: per layer and tensor kind, a bit width (2..8), 16 or
"recompute", or the whole layer checkpointed, plus gradient storage, optimizer state, micro-batch x
accumulation and compile mode, chosen so that every pipeline stage's predicted peak memory stays within the
budget.

Objectives (--objective):
  time   (default) the most tokens/s, within an error cap: by default (--error-cap recipe) no more predicted
         gradient error than the published agoq-paper recipe on this profile; the plan states the cap
  error  the least predicted gradient error (ties: the most tokens/s); add --time-cap checkpoint to be no
         slower than the best checkpointing that fits (the behaviour of agoq before 1.1)

Every plan records why it was chosen (plan "decision": the caps, the constraint that binds - memory budget,
error cap, time cap or none - and the knob values) and the best alternative that fits the same budget
(plan "alternative": the fastest of bf16, selective/full checkpointing and, where the profile has compiled
steps, torch.compile with activation_memory_budget, each with float32 or 8-bit AdamW), with the speed-up.

  milp    exact per-layer choice with the MILP solver HiGHS, plus the memory/error Pareto front over
          --front-budgets budgets (from the smallest feasible one to the unconstrained plan's peak)
  optuna  a multi-objective Optuna study (memory, time, error) over the knobs the MILP cannot add up:
          block size, 4-bit format, gradient mode, micro-batch x gradient accumulation, per-kind floor
          bits, pipeline stage boundaries; each trial's per-layer choice is solved by the MILP, and the
          first trial is the MILP plan. The study is stored (default OUT_STEM.study.db beside the plan, SQLite)
          and an interrupted search resumes where it stopped when run again.
  both    the two together (default for --method when --trials is given)

Writes the chosen plan (--out), OUT_STEM.pareto.csv beside it (one row per Pareto-optimal plan, MILP and Optuna)
and the front's plans in OUT_STEM-pareto/: every file is named after the plan (plan.json: plan.pareto.csv,
plan-pareto/, plan.study.db), so searches into one folder with different --out change none of each other's files.
An --out that is an agoq plan is replaced with its files (said on stderr); any other existing file is refused.
Where no plan fits --budget, nothing is written and it exits 2, naming the smallest budget that fits.
With --validate K, the K best plans are run for real (a few steps of `agoq train`'s own training, in this
process, on its built-in synthetic corpus: agoq.train.measure) and the measured peak memory (GPU only; the largest
of any step, the first included), step time and loss deviation from bf16 are written into the plans, the Pareto
CSV and the study.

The printout says what the plan is and why; the notes on how the cost model was calibrated from the profile's
measured steps are summed up in one line (all of them with --verbose; the plan file keeps them in source.notes).

What-if (--world-size N, --node-size G, --network SPEC): plan for N ranks in nodes of G from a profile of fewer
(agoq.search.whatif): compute per rank from the profile's measured steps, every collective from a latency-bandwidth
model (NCCL's ring and tree terms, two levels: inside a node and across nodes) fitted to the profile's measured
collectives (the fit and its residuals are printed) or on the --network links, memory per rank from the layout (a
sharded state 1/N; hsdp's, offered over several nodes, 1/G: sharded within a node, replicated across). The plan
says it is a what-if (plan "whatif": measured and planned world, the network, what is extrapolated, what to run first
on the real cluster). Without --world-size the search plans for the profile's world.

Example:  agoq search --profile runs/probe-profile --budget 30GiB --out runs/probe-plan/plan.json
          agoq search --profile runs/probe-2gpu --budget 60GB --out runs/whatif/plan.json
              --world-size 64 --node-size 8 --network nvlink-h100+ib-ndr400    (a what-if, one command line)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agoq.commands.arguments import flag, positive_int, request_field
from agoq.search.request import (
    COMPILE_MODES,
    DEFAULT_ERROR_CAP,
    DEFAULT_OBJECTIVE,
    DEFAULT_TIME_CAP,
    GRADIENTS,
    LAYOUTS,
    MASTERS,
    METHODS,
    OBJECTIVES,
    OPTIMIZERS,
    SAMPLERS,
    WORDS,
    BadField,
    SearchRequest,
)
from agoq.files import check_output_file
from agoq.units import format_bytes

HELP = "turn a profile and a memory budget into a plan (MILP, Optuna)"


def _ranges(layers: list[int]) -> str:
    """Sorted layer indices as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}-{layer}" if layer > start else f"{layer}")
            start = None
    return ", ".join(out)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `agoq search`'s arguments. Those of the search request (agoq.search.request.WORDS) are read by the
    request's own rules, as the dashboard's plan service reads its JSON fields."""
    def field(name: str, **kwargs) -> None:
        parser.add_argument(flag(name), type=request_field(name), **kwargs)

    parser.add_argument("--profile", required=True, help="profile folder written by `agoq profile` (profile.json, "
                                                         "profile.parquet)")
    field("budget", required=True, help="memory budget per GPU (each pipeline stage), e.g. 30GiB, 1.5GB or bytes "
                                        "(more than 0, at most 1 PiB)")
    parser.add_argument("--out", required=True, help="the plan file to write, e.g. plan.json; beside it, named after "
                                                    "it: OUT_STEM.pareto.csv, the front's plans in OUT_STEM-pareto/ "
                                                    "and the study OUT_STEM.study.db. An agoq plan already there is "
                                                    "replaced with those files; any other file is refused")
    field("method", choices=METHODS, default=None,
          help="milp (exact, default), optuna (knobs, multi-objective) or both "
               "(default: both when --trials is given, else milp)")
    field("objective", choices=OBJECTIVES, default=DEFAULT_OBJECTIVE,
          help="time: the most tokens/s that fits the budget within --error-cap; error: the least "
               f"predicted gradient error (default {DEFAULT_OBJECTIVE})")
    field("time_cap", default=DEFAULT_TIME_CAP, metavar="SECONDS|checkpoint|none",
          help="largest predicted step time allowed: seconds, 'checkpoint' (no slower than the "
               "fastest full-or-selective activation checkpointing that fits the budget; no cap "
               "when none fits) or 'none' (default none). With --objective error and no cap, "
               "the least error prefers recomputation, which has none from a 16-bit source")
    field("error_cap", default=DEFAULT_ERROR_CAP, metavar="ERROR|recipe|none",
          help="largest predicted gradient error allowed (sum of sensitivities, relative L2; a kind "
               "recomputed from a quantized source counts its own at the source's bits): a "
               "number, 'recipe' (the predicted error of the published agoq-paper recipe on this "
               f"profile) or 'none' (default {DEFAULT_ERROR_CAP})")
    field("gradients", choices=GRADIENTS, default="any",
          help="gradient storage the plan may use (default any the profile prices; QuanGrad's "
               "8-bit rounding is not part of the error cap)")
    field("layout", choices=LAYOUTS, default="any",
          help="data-parallel layout over a several-rank profile's ranks: replicated (DDP), fsdp (PyTorch "
               "FSDP2, bf16 or TLq-HS reduce-scatter, with TLq-HS also agoq's int8 or int4 weight all-gather; priced "
               "from the profile's all-gather and reduce-scatter timings, calibrated on its multi-rank layout steps "
               "where it measured them) or hsdp (FSDP2 sharded within a node, its shards all-reduced across nodes "
               "exactly, by QuanGrad's 8 bits or TLq's 4; offered only where the ranks span nodes: a what-if with "
               "--world-size N --node-size S, 1 < S < N; launched as --parallel hsdp --node-size S); the "
               "alternatives a plan is compared with, and falls back to, are of this layout too (default any it "
               "prices). agoq's own sharded layout (sharded) was retired: search --layout fsdp")
    field("optimizer", choices=OPTIMIZERS, default="any",
          help="optimizer state: adamw (float32 moments) or adamw8bit (agoq's fused 8-bit AdamW) "
               "(default any)")
    field("master", choices=MASTERS, default="fp32",
          help="float32 master weights: fp32 (default), none (bf16 parameters with stochastic "
               "rounding; adamw8bit only, its effect is not part of the error cap) or any")
    field("compile", choices=COMPILE_MODES, default="any",
          help="compile mode: the profile's own, or 'compiled' where the profile has compiled step "
               "times (agoq profile --compile); default any the profile prices")
    field("global_batch", default=None, metavar="SEQUENCES",
          help="sequences per optimizer step, split into micro-batch x accumulation by the search "
               "(default: the profiled micro-batch)")
    field("micro_batch", default=None, metavar="SEQUENCES",
          help="fix the micro-batch (it must divide the global batch; default: try every divisor)")
    field("offload", choices=(True, False), default=None, metavar="on|off",
          help="whether whole layers' saved tensors (bf16, or agoq's codes) may be kept in pinned host memory, "
               "priced by the host link and offloading steps the profile measured (GPU profiles since agoq "
               "measures them; with a profile that did not, the search says so): on (default) or off")
    field("host_budget", default=None, metavar="SIZE",
          help="pinned host memory offload may hold per process, e.g. 64GB (default: the profile's pinnable "
               "bytes, half of the host memory available when it was made)")
    field("quantize_attention", choices=(True, False), default=False, metavar="on|off",
          help="whether attention's q, k and v may be kept at a bit width (attention then runs again in "
               "backward): off (default, as agoq-paper) or on. The profile measures sensitivities on fresh "
               "weights, where attention's are 30-80x lower than after training (docs/search.md, Attention)")
    field("trials", default=None,
          help="Optuna trials the study should hold in total (default 40 with --method optuna/both)")
    field("sampler", choices=SAMPLERS, default="nsga2",
          help="Optuna sampler, both honour the budget as a constraint (default nsga2)")
    parser.add_argument("--runs", nargs="+", default=[], metavar="RUN_DIR",
                        help="run folders of `agoq train --plan` with plans from this profile: what really ran "
                             "corrects the search's calibration (a peak above its prediction raises the margin; step "
                             "times at a split are scaled by measured / predicted over its runs)")
    parser.add_argument("--storage", default=None,
                        help="Optuna storage: a database URL (sqlite:///file.db, postgresql://...) or a path "
                             "ending in .journal (several processes on one file system); default "
                             "sqlite:///OUT_DIR/OUT_STEM.study.db, or OUT_STEM.study.journal with --workers > 1)")
    parser.add_argument("--study-name", default="agoq-search", help="Optuna study name (default agoq-search)")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="trials measured at a time (with --measure-trials, on Ray); >1 also means other "
                             "processes may share the study, so interrupted trials are not failed (default 1)")
    parser.add_argument(flag("measure_trials"), action="store_true",
                        help="run every feasible Optuna trial's plan for real and use measured peak and time")
    parser.add_argument("--ray-address", default=None,
                        help="run measurements as Ray tasks: 'local' starts Ray on this machine, an address "
                             "(e.g. ray://head:10001 or auto) joins a cluster (default: no Ray, in this process)")
    field("validate", default=0, metavar="K",
          help="run the K best plans for real and record measured figures (default 0)")
    field("validate_steps", default=4,
          help="training steps per measured plan, the first not timed (its peak counts) (default 4)")
    field("front_budgets", default=8,
          help="budgets of the MILP memory/error Pareto front (default 8; 0: none)")
    field("seed", default=0, help="seed of the Optuna sampler and the measured runs")
    add_whatif_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--verbose", action="store_true",
                        help="print every note of the cost model's calibration (by default one line sums them up; "
                             "the plan file keeps them all in source.notes)")
    parser.set_defaults(func=run)


def add_whatif_arguments(parser: argparse.ArgumentParser) -> None:
    """--world-size, --node-size, --network: plan for a cluster the profile was not measured on."""
    from agoq.search.network_spec import SPEC_HELP

    parser.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                        help="plan for N ranks (a what-if from a profile of fewer; default: the profile's world)")
    parser.add_argument("--node-size", type=positive_int, default=None, metavar="G",
                        help="ranks per node of that cluster; N must be a multiple (default: the profiled machine's "
                             "GPU count, at most N)")
    parser.add_argument("--network", default=None, metavar="SPEC",
                        help=f"the cluster's links: {SPEC_HELP} (default: the profile's own link, fitted to its "
                             "measured collectives)")


def whatif_profile(args: argparse.Namespace, profile):
    """(profile, WhatIf) re-targeted as --world-size / --node-size / --network ask, or (profile, None) when none is
    given; ValueError naming the flag otherwise."""
    if args.world_size is None and args.node_size is None and args.network is None:
        return profile, None
    if args.validate or args.measure_trials:
        raise ValueError("--validate and --measure-trials run plans on this machine: a what-if plan for another "
                         "cluster (--world-size, --node-size, --network) cannot be run here; drop one or the other")
    from agoq.search.whatif import retarget

    world = profile.world_size if args.world_size is None else args.world_size
    return retarget(profile, world, args.node_size, args.network)


def read_request(args: argparse.Namespace) -> SearchRequest:
    """The search request of `agoq search`'s parsed flags; ValueError naming the flag of a value refused."""
    try:
        return SearchRequest.read({name: getattr(args, name) for name in WORDS})
    except BadField as e:
        raise ValueError(f"{flag(e.field)}: {e.problem}") from None


def check_out(out: Path) -> Path:
    """`out` if `agoq search` may write its plan there: a .json file in a writable folder, absent or an agoq plan
    (which it replaces); ValueError saying what to do otherwise."""
    from agoq.formats.plan import is_plan_file

    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {out}")
    check_output_file(out, "--out")
    if out.exists() and not is_plan_file(out):
        raise ValueError(f"--out {out} exists and is not an agoq plan (a JSON object with \"schema\": "
                         "\"agoq.plan/...\"): agoq search replaces only a plan it wrote; move that file away or give "
                         "another --out")
    return out


def offload_notes(profile, outcome, asked: bool) -> list[str]:
    """Why the plan of a search that `asked` for offload (--offload, --host-budget) offloads nothing: the profile
    measured no host link, or the cost model's notes on why it offers no offload; [] otherwise."""
    from agoq.search.search import unpriced_offload_note

    if not asked or outcome.plan.offload_layers():
        return []
    missing = unpriced_offload_note(profile)
    if missing is not None:
        return [missing]
    return [n for n in dict.fromkeys(outcome.notes) if n.startswith("offload to host memory is not offered")]


def print_notes(notes: list[str], said: list[str], measured_steps: int, verbose: bool) -> None:
    """On stderr: the notes `said` (what the user should read: a roomier budget, why nothing offloads), and the cost
    model's `notes`, all of them with `verbose`, else one line that says how many there are and where."""
    notes = [n for n in dict.fromkeys(notes) if n not in said]
    for note in list(dict.fromkeys(said)) + (notes if verbose else []):
        print(f"  note: {note}", file=sys.stderr)
    if notes and not verbose:
        basis = f"cost model calibrated on the profile's {measured_steps} measured steps; " if measured_steps else ""
        print(f"  {basis}{len(notes)} note{'s' if len(notes) > 1 else ''} on how it priced this plan: agoq search "
              "--verbose prints them, the plan file keeps them (source.notes)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run `agoq search`; returns the exit code."""
    from agoq.formats.measured_steps import measured_rows
    from agoq.formats.profile import load_profile
    from agoq.search.memory_parts import phase_name
    from agoq.search.request import InfeasibleBudget
    from agoq.search.search import keep_notes, roomier_plan_note, search, side_files, write_outputs
    from agoq.search.study import storage_file

    request = read_request(args)
    out = check_out(Path(args.out))
    files = side_files(out)
    storage = args.storage
    if storage is None:  # named after the plan, as its other files
        storage = str(files["journal"].resolve()) if args.workers > 1 else f"sqlite:///{files['study'].resolve()}"
    if storage_file(storage) is not None:
        check_output_file(storage_file(storage), "--storage")
    profile = load_profile(args.profile)
    if args.runs:
        from agoq.formats.run import measured_against_plan

        profile = profile.with_runs([measured_against_plan(run) for run in args.runs])
        other = [r["run"] for r in profile.runs if r["fingerprint"] != profile.fingerprint]
        if other:
            raise ValueError(f"--runs {' '.join(other)}: trained another model than the profile's "
                             f"({profile.model_name}, fingerprint {profile.fingerprint})")
    profile, whatif = whatif_profile(args, profile)
    measure = None
    if request.validate or request.measure_trials:  # the search runs plans with agoq train's own step
        from agoq.train.measure import measure_plan as measure
    try:
        outcome = search(profile, request, storage=storage, study_name=args.study_name, ray_address=args.ray_address,
                         parallel=args.workers, out_dir=out.parent, progress=not args.quiet, measure=measure)
    except InfeasibleBudget as e:
        raise ValueError(f"{e.advice(flag)} (profile {profile.path})") from None
    if out.exists():
        print(f"agoq search: replacing the plan {out} and its front ({files['pareto'].name}, {files['plans'].name}/) "
              "with this search's", file=sys.stderr)
    asked = args.offload is not None or args.host_budget is not None
    said = list(outcome.said) + offload_notes(profile, outcome, asked)
    roomier = None if request.budget is None else roomier_plan_note(profile, request, outcome.plan,
                                                                    progress=not args.quiet)
    if roomier is not None:
        said.append(roomier)
    keep_notes(outcome.plan, said)  # the search kept its own notes in the plan; these go with them
    if whatif is not None:
        from agoq.search.whatif import mark_plans

        mark_plans(outcome, whatif)
    written = write_outputs(outcome, out)
    plan = outcome.plan
    pred = plan.predicted
    device = plan.source.device
    print(f"plan for {plan.model.name} under {format_bytes(request.budget)} per GPU ({plan.source.method}, "
          f"objective {request.objective}{', profiled on ' + device if device else ''}):")
    print(f"  predicted peak {', '.join(format_bytes(b) for b in pred.peak_bytes_per_stage)} per stage; "
          f"activations {', '.join(format_bytes(b) for b in pred.activation_bytes_per_stage) or '-'}; "
          f"step {pred.step_seconds:.4f} s; gradient error {pred.grad_error:.4g}")
    counts: dict = {}
    for lp in plan.layers:
        if lp.checkpoint:
            counts["checkpoint"] = counts.get("checkpoint", 0) + 1
            continue
        for setting in lp.kinds.values():
            counts[str(setting)] = counts.get(str(setting), 0) + 1
    print("  choices: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    offloaded = plan.offload_layers()
    if offloaded:
        link = f"; the copies out and back take {pred.offload_link_seconds * 1e3:.1f} ms of link time per step" \
            if getattr(pred, "offload_link_seconds", None) is not None else ""
        host = f" ({format_bytes(pred.host_bytes)} pinned per micro-batch{link})" \
            if getattr(pred, "host_bytes", None) is not None else ""
        print(f"  offload: layers {_ranges(offloaded)} keep their saved tensors in host memory{host}")
    phases = [phase_name(m.phase, m.layer) for m in pred.memory_per_stage or []]
    if phases:
        print("  peak set at: " + ", ".join(f"stage {i}: {ph}" if len(phases) > 1 else ph
                                            for i, ph in enumerate(phases)))
    if pred.compile_graphs:
        cost = f", about {pred.compile_seconds:.0f} s before the first step in a fresh process" \
            if pred.compile_seconds is not None else ""
        print(f"  compiles {pred.compile_graphs} layer graph{'s' if pred.compile_graphs > 1 else ''}{cost} (the "
              "profile's first compiled steps; less with Inductor's cache warm)")
    d = plan.decision
    if d is not None:
        k = d.knobs
        print(f"  knobs: gradients {k.get('gradients')}, optimizer {k.get('optimizer')} (masters {k.get('master')}), "
              f"micro-batch {k.get('micro_batch')} x {k.get('grad_accum')}, {k.get('compile')}; "
              f"{d.tokens_per_second:,.0f} tokens/s predicted")
        print(f"  why: {d.reason}")
    alt = plan.alternative
    if alt is not None:
        speed = f"; plan is {alt.speedup_predicted:.2f}x its tokens/s" if alt.speedup_predicted else ""
        print(f"  best alternative that fits: {alt.name}: predicted step {alt.predicted.step_seconds:.4f} s, peak "
              f"{format_bytes(alt.predicted.peak_bytes)}{speed}")
        if alt.measured is not None and alt.measured.step_seconds is not None:
            peak = alt.measured.peak_bytes
            sm = f", plan measured {alt.speedup_measured:.2f}x" if alt.speedup_measured else ""
            print(f"    measured: step {alt.measured.step_seconds:.4f} s, peak "
                  f"{format_bytes(peak) if peak is not None else 'not measured'}{sm}")
    elif d is not None:
        print("  best alternative that fits: none (bf16, checkpointing and compiled alternatives all exceed the "
              "budget)")
    if plan.measured is not None:
        m = plan.measured
        peak = m.peak_bytes_per_stage[0] if m.peak_bytes_per_stage else None
        print(f"  measured: peak {format_bytes(peak) if peak is not None else 'not measured'}, step "
              f"{m.step_seconds:.4f} s, loss deviation from bf16 {m.loss_deviation:.3%}")
    if outcome.trials_total:
        print(f"  optuna: {outcome.trials_run} trial(s) run now, {outcome.trials_total} in the study")
    if whatif is not None:
        for line in whatif.summary_lines(plan):
            print(line)
    print_notes(outcome.notes, said, len(measured_rows(profile.header)), args.verbose)
    print(f"wrote {written['plan']}, {written['pareto']} and {written['plans']}/")
    return 0
