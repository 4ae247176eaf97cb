"""Show what agoq buys on a GPU, then run agoq's whole loop on the tiny LLaMA on the CPU, in about a minute or
two, and print the command that shows the results in the dashboard:

  0. agoq search, in this process, on the profiles of a real model (the 1.1 B-parameter probe) measured on real GPUs
     that agoq ships (agoq.examples): at a few budgets, agoq's plan against the fastest alternative that fits without
     agoq, as predicted from those profiles (measured figures: docs/results.md)
  1. agoq profile llama-tiny              -> OUT/profile/   (bytes, error, sensitivity per layer and kind;
                                                             collective times between two local processes)
  2. agoq search --budget B               -> OUT/search/    (plan.json, plan.pareto.csv, Optuna study)
     B is the predicted peak of the published LAAQ recipe (agoq-paper) on this model; the search (MILP)
     looks for the fastest plan within it, then runs the two best plans for a few steps to measure them;
     a plan sharded over several processes (FSDP2) cannot train here, so the demo then also
     searches one replicated with QuanGrad's 8-bit gradients (-> OUT/search-one-process/) to train
  3. agoq train llama-tiny                -> OUT/runs/baseline/ (no plan: plain training, in float32 on the CPU)
     agoq train llama-tiny --plan ...     -> OUT/runs/plan/     (the same steps with the searched plan)
  4. copies the shipped GPU profiles to OUT/examples/, so that the dashboard's budget slider plans for them too,
     and `agoq search --profile OUT/examples/NAME`
  5. prints `agoq dashboard --root OUT`

Steps 1-3 check that training with a plan works end to end; on the CPU agoq's quantization runs as its PyTorch
reference code, so their step times and memory are the CPU's and say nothing of what agoq buys on a GPU (step 0).
Each step runs the same command a user would type (its module in agoq.commands, with its own parser).

The demo records every file and folder it writes in OUT/agoq-demo.json as it goes (agoq.commands.demo_folder);
--force replaces exactly those, and agoq demo refuses, naming them, anything in the folders it writes that it did
not write. Files elsewhere in OUT are left alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from agoq.commands import demo_folder, profile, search, train
from agoq.commands.arguments import positive_int, run_module
from agoq.commands.demo_folder import RECORD, DemoRecord, NotARecord
from agoq.files import check_output_folder
from agoq.layout import SHARDED_MODES
from agoq.parallel_dims import plan_dims

HELP = "what agoq buys on a GPU (predicted from shipped profiles), then the whole loop on a tiny model on the CPU"
MODEL = "llama-tiny"
STAGES = {"profile": profile, "search": search, "train": train}
# measured widths and formats kept small so the CPU profile takes seconds, not minutes; collectives
# timed over gloo between two local processes
PROFILE_ARGS = ["--bits", "2,3,4,6,8", "--formats", "int", "--batches", "1", "--world-size", "2",
                "--collective-sizes", "16KiB,64KiB,256KiB"]
SEARCH_ARGS = ["--objective", "time", "--validate", "2", "--validate-steps", "3"]
TRAIN_ARGS = ["--eval-every", "10", "--eval-batches", "2", "--checkpoint-every", "0"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `agoq demo`."""
    parser.add_argument("--out", default="runs/demo",
                        help="folder for everything the demo writes (default runs/demo)")
    parser.add_argument("--steps", type=positive_int, default=200,
                        help="training steps of each of the two runs (default 200)")
    parser.add_argument("--force", action="store_true",
                        help=f"replace an earlier demo in --out: exactly the files and folders it recorded writing in "
                             f"OUT/{RECORD} (under profile/, search/, search-one-process/, runs/baseline/, runs/plan/ "
                             "and examples/NAME/); anything else in --out is left alone, and a file in those folders "
                             "that the demo did not write makes it refuse, naming it")
    parser.add_argument("--quiet", action="store_true", help="no progress bars from the stages")
    parser.set_defaults(func=run)


class StageFailed(Exception):
    """A stage command of the demo exited with an error (which it has already printed)."""


def _stage(argv: list[str]) -> None:
    print(f"\n$ agoq {' '.join(argv)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    code = run_module(STAGES[argv[0]], argv[1:], f"agoq {argv[0]}")
    print(f"({argv[0]}: {time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    if code != 0:
        raise StageFailed(f"`agoq {' '.join(argv)}` failed with exit code {code} (its message is above)")


def demo_budget(profile_dir: Path) -> int:
    """A memory budget (bytes): the predicted peak of a step with the published LAAQ recipe
    (agoq-paper) from the profile, well below plain bf16's, so the search has to trade."""
    meta = json.loads((profile_dir / "profile.json").read_text())
    steps = [s for s in (meta.get("memory") or {}).get("steps") or [] if s.get("predicted_peak_bytes")]
    by_policy = {s["policy"]: int(s["predicted_peak_bytes"]) for s in steps}
    if "agoq-paper" in by_policy:
        return by_policy["agoq-paper"]
    if "bf16" in by_policy and len(by_policy) >= 2:
        return (by_policy["bf16"] + min(by_policy.values())) // 2
    raise ValueError(f"{profile_dir / 'profile.json'}: memory.steps lacks the predicted peaks of agoq-paper "
                     "(or of bf16 and another policy), which the demo needs to pick a budget")


def _stage_in(record: DemoRecord, part: str, argv: list[str]) -> None:
    """Run a stage that writes the demo's `part` of OUT, recorded before it starts and listed once it ends."""
    with record.writing(part):
        _stage(argv)


def run_loop(out: Path, steps: int = 40, quiet: bool = False, profile_args: list[str] | None = None,
             search_args: list[str] | None = None, train_args: list[str] | None = None,
             record: DemoRecord | None = None) -> dict[str, Path]:
    """Profile, search and train (the baseline without a plan, and with the plan) into `out`; returns the folders
    written. What each stage writes goes into `record` (default: a new record of `out`, OUT/agoq-demo.json) as it goes.
    The *_args lists replace the demo's extra arguments of each stage (tests use them to go faster)."""
    if record is None:
        record = DemoRecord(out)
        record.save()
    q = ["--quiet"] if quiet else []
    paths = {"profile": out / "profile", "search": out / "search", "baseline": out / "runs" / "baseline",
             "plan_run": out / "runs" / "plan", "plan": out / "search" / "plan.json"}
    _stage_in(record, "profile", ["profile", MODEL, "--device", "cpu", "--out", str(paths["profile"]), *q,
                                  *(PROFILE_ARGS if profile_args is None else profile_args)])
    budget = demo_budget(paths["profile"])
    # the demo trains in one process: the search keeps to layouts that run there (DDP's, replicated)
    _stage_in(record, "search", ["search", "--profile", str(paths["profile"]), "--budget", str(budget), "--out",
                                 str(paths["plan"]), "--layout", "replicated", *q,
                                 *(SEARCH_ARGS if search_args is None else search_args)])
    plan = json.loads(paths["plan"].read_text())
    trained = paths["plan"]
    dims = plan_dims(plan)  # its parallel section (agoq.parallel_dims)
    parallel = dims.mode if dims is not None else None
    if parallel in SHARDED_MODES or (plan.get("gradients") or {}).get("mode") == "sdp4bit":
        # a sharded layout (FSDP2, TLq-HS with sdp4bit gradients) needs several processes, and agoq train runs a plan as it was
        # searched: one process trains the plan searched replicated with QuanGrad's 8-bit gradients instead
        print(f"agoq demo: the plan shards over several processes ({parallel}); this single-process demo trains "
              "the plan searched with --layout replicated --gradients quangrad8 instead", file=sys.stderr)
        paths["one_process"] = out / "search-one-process" / "plan.json"
        _stage_in(record, "search-one-process",
                  ["search", "--profile", str(paths["profile"]), "--budget", str(budget), "--out",
                   str(paths["one_process"]), "--layout", "replicated", "--gradients", "quangrad8", *q,
                   *(SEARCH_ARGS if search_args is None else search_args)])
        trained = paths["one_process"]
        plan = json.loads(trained.read_text())
    # both runs train on the batch shape the plan was made for, so their curves compare
    training = plan.get("training") or {}
    shape = [arg for flag, key in (("--seq-len", "seq_len"), ("--micro-batch", "micro_batch"),
                                   ("--grad-accum", "grad_accum"))
             if training.get(key) for arg in (flag, str(training[key]))]
    common = ["--device", "cpu", "--steps", str(steps), *shape, *q,
              *(TRAIN_ARGS if train_args is None else train_args)]
    _stage_in(record, "runs/baseline", ["train", MODEL, "--out", str(paths["baseline"]), *common])
    _stage_in(record, "runs/plan", ["train", MODEL, "--plan", str(trained), "--out", str(paths["plan_run"]), *common])
    return paths


def shipped_profiles() -> dict[str, Path]:
    """{name: folder} of agoq's example profiles (agoq.examples), which the demo copies to OUT/examples/NAME."""
    from agoq.examples import profiles

    return profiles()


def copy_examples(out: Path, record: DemoRecord) -> list[str]:
    """Copy agoq's example profiles into OUT/examples/, each recorded in `record`; returns their names."""
    names = []
    for name, source in shipped_profiles().items():
        with record.writing(f"examples/{name}") as folder:
            shutil.copytree(source, folder)
        names.append(name)
    return names


def demo_parts() -> list[str]:
    """The parts of OUT a demo may write (agoq.commands.demo_folder)."""
    return [*demo_folder.FIXED_PARTS, *(f"examples/{name}" for name in shipped_profiles())]


def clear_the_way(out: Path, force: bool) -> None:
    """Make room for a demo in `out`: nothing there but an earlier demo's parts, which go with `force`. Raises
    ValueError naming what is in the way (and what to do) otherwise."""
    try:
        found = demo_folder.inspect(out, demo_parts())
    except NotARecord as e:
        raise ValueError(f"--out {out}: {e}; agoq demo will not write over it: move it, or give another "
                         "--out") from None
    if found.foreign:
        whose = (f"which agoq demo's record there ({out / RECORD}) does not list" if found.record is not None else
                 f"and there is no demo record ({RECORD}) there, so agoq demo did not write them (an agoq older "
                 "than this one wrote no record: remove the folders of its demo yourself)")
        raise ValueError(f"--out {out} holds {found.named()} where agoq demo writes, {whose}: agoq demo neither "
                         "replaces nor mixes with what it did not write; move them, or give another --out")
    if found.earlier and not force:
        raise ValueError(f"--out {out} already holds an earlier demo ({', '.join(p + '/' for p in found.earlier)}); "
                         f"pass --force to replace it (exactly what it recorded writing, in {out / RECORD}), or "
                         "another --out")
    demo_folder.remove(out, found)


def gpu_comparison() -> list[str]:
    """Step 0: the shipped GPU profiles' plans against the alternatives (agoq.commands.demo_gpu), said now; returns
    one headline per profile for the closing lines."""
    from agoq.commands.demo_gpu import RESULTS, profile_lines

    start = time.monotonic()
    print("What agoq buys on a GPU: agoq search on profiles measured on GPUs that agoq ships (agoq.examples), "
          "agoq's plan against the fastest configuration that fits without agoq (bf16, checkpointing, torch.compile, "
          "8-bit AdamW), predicted tokens/s at a few memory budgets per GPU:", flush=True)
    headlines = []
    for name, folder in shipped_profiles().items():
        try:
            lines, headline = profile_lines(name, folder)
        except (ValueError, OSError) as e:  # one unreadable profile leaves the others and the CPU loop to run
            lines, headline = [f"  shipped profile {name}: cannot plan from it ({e})"], None
        print("\n".join(lines), flush=True)
        headlines += [headline] if headline else []
    print(f"(searched in {time.monotonic() - start:.0f} s on this machine; what plans like these measured when "
          f"trained on an H100 and an H200, against the alternative trained beside them: {RESULTS} in agoq's "
          "repository, \"Plans as a user runs them\")", flush=True)
    return headlines


CPU_CHECK = ("Next, the whole loop on the CPU with a tiny LLaMA: profile, search, train without and with the plan. "
             "It checks that training with a plan works end to end. On the CPU agoq's quantization runs as its PyTorch "
             "reference code, not its GPU kernels, so these runs' step times and memory are the CPU's: they are not "
             "what a plan is for, and they say nothing of the figures above.")


def run(args: argparse.Namespace) -> int:
    """Show the GPU comparison, run the demo's loop on the CPU and print the dashboard command."""
    out = check_output_folder(args.out, "--out")
    clear_the_way(out, args.force)
    start = time.monotonic()
    record = DemoRecord(out)
    record.save()
    headlines = gpu_comparison()
    print(f"\n{CPU_CHECK}", flush=True)
    try:
        run_loop(out, steps=args.steps, quiet=args.quiet, record=record)
    except StageFailed as e:
        print(f"agoq demo: {e}", file=sys.stderr)
        return 1
    examples = copy_examples(out, record)
    record.finish()
    root = out.resolve()
    print(f"\nagoq demo: done in {time.monotonic() - start:.0f} s; everything is in {root}")
    print("  on a GPU (predicted by agoq search from the shipped profiles, at the top): "
          + ("; ".join(headlines) if headlines else "no shipped profile to plan from"))
    print("  on this CPU (runs/baseline, runs/plan): training with a plan works; their speed and memory are the "
          "CPU's, not what agoq plans for")
    if examples:
        print(f"  plan for the GPU profiles yourself: agoq search --profile {root / 'examples' / examples[0]} "
              "--budget 12GB --out plan.json")
    print(f"see it all with:\n\n  agoq dashboard --root {root}\n\nthen open http://127.0.0.1:8000/")
    return 0
