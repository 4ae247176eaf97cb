"""Run agoq's whole loop on the tiny LLaMA on the CPU, in about a minute or two, then print the command
that shows the results in the dashboard:

  1. agoq profile llama-tiny              -> OUT/profile/   (bytes, error, sensitivity per layer and kind;
                                                             collective times between two local processes)
  2. agoq search --budget B               -> OUT/search/    (plan.json, pareto.csv, Optuna study)
     B is the predicted peak of the published LAAQ recipe (agoq-paper) on this model; the search (MILP)
     looks for the fastest plan within it, then runs the two best plans for a few steps to measure them;
     a plan sharded over several processes (SDP4Bit or FSDP2) cannot train here, so the demo then also
     searches one replicated with QuanGrad's 8-bit gradients (-> OUT/search-one-process/) to train
  3. agoq train llama-tiny                -> OUT/runs/baseline/ (no plan: plain training, in float32 on the CPU)
     agoq train llama-tiny --plan ...     -> OUT/runs/plan/     (the same steps with the searched plan)
  4. copies the profiles of real models measured on real GPUs that agoq ships (agoq.examples) to OUT/examples/,
     so that the dashboard's budget slider plans for them too, and `agoq search --profile OUT/examples/NAME`
  5. prints `agoq dashboard --root OUT`

Each step runs the same command a user would type (its module in agoq.commands, with its own parser).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from agoq.commands import profile, search, train
from agoq.commands.arguments import positive_int, run_module
from agoq.files import check_output_folder
from agoq.layout import SHARDED_MODES

HELP = "the whole loop on a tiny model on the CPU, then the dashboard command to see it"
MODEL = "llama-tiny"
STAGES = {"profile": profile, "search": search, "train": train}
DEMO_PARTS = ("profile", "search", "runs", "examples")
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
                        help="replace the results of an earlier demo in --out (its profile/, search/ and runs/)")
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


def run_loop(out: Path, steps: int = 40, quiet: bool = False, profile_args: list[str] | None = None,
             search_args: list[str] | None = None, train_args: list[str] | None = None) -> dict[str, Path]:
    """Profile, search and train (the baseline without a plan, and with the plan) into `out`; returns the folders
    written.
    The *_args lists replace the demo's extra arguments of each stage (tests use them to go faster)."""
    q = ["--quiet"] if quiet else []
    paths = {"profile": out / "profile", "search": out / "search", "baseline": out / "runs" / "baseline",
             "plan_run": out / "runs" / "plan", "plan": out / "search" / "plan.json"}
    _stage(["profile", MODEL, "--device", "cpu", "--out", str(paths["profile"]), *q,
            *(PROFILE_ARGS if profile_args is None else profile_args)])
    budget = demo_budget(paths["profile"])
    # the demo trains in one process: the search keeps to layouts that run there (DDP's, replicated)
    _stage(["search", "--profile", str(paths["profile"]), "--budget", str(budget), "--out", str(paths["plan"]),
            "--layout", "replicated", *q, *(SEARCH_ARGS if search_args is None else search_args)])
    plan = json.loads(paths["plan"].read_text())
    trained = paths["plan"]
    parallel = (plan.get("launch") or {}).get("parallel")
    if parallel in SHARDED_MODES or (plan.get("gradients") or {}).get("mode") == "sdp4bit":
        # a sharded layout (agoq's SDP4Bit or FSDP2) needs several processes, and agoq train runs a plan as it was
        # searched: one process trains the plan searched replicated with QuanGrad's 8-bit gradients instead
        print(f"agoq demo: the plan shards over several processes ({parallel}); this single-process demo trains "
              "the plan searched with --layout replicated --gradients quangrad8 instead", file=sys.stderr)
        paths["one_process"] = out / "search-one-process" / "plan.json"
        _stage(["search", "--profile", str(paths["profile"]), "--budget", str(budget), "--out",
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
    _stage(["train", MODEL, "--out", str(paths["baseline"]), *common])
    _stage(["train", MODEL, "--plan", str(trained), "--out", str(paths["plan_run"]), *common])
    return paths


def copy_examples(folder: Path) -> list[str]:
    """Copy agoq's example profiles (agoq.examples) into `folder`; returns their names."""
    from agoq.examples import profiles

    names = []
    for name, source in profiles().items():
        shutil.copytree(source, folder / name, dirs_exist_ok=True)
        names.append(name)
    return names


def run(args: argparse.Namespace) -> int:
    """Run the demo and print the dashboard command."""
    out = check_output_folder(args.out, "--out")
    earlier = [out / p for p in DEMO_PARTS if (out / p).exists()]
    if earlier and not args.force:
        raise ValueError(f"--out {out} already holds an earlier demo ({', '.join(p.name for p in earlier)}); "
                         "pass --force to replace it, or another --out")
    for p in earlier:
        shutil.rmtree(p)
    start = time.monotonic()
    try:
        run_loop(out, steps=args.steps, quiet=args.quiet)
    except StageFailed as e:
        print(f"agoq demo: {e}", file=sys.stderr)
        return 1
    examples = copy_examples(out / "examples")
    root = out.resolve()
    if examples:
        print(f"agoq demo: profiles of real models on real GPUs, to plan from: {', '.join(examples)} (in "
              f"{root / 'examples'}; e.g. agoq search --profile {root / 'examples' / examples[0]} --budget 12GB "
              f"--out plan.json)", file=sys.stderr)
    print(f"\nagoq demo: done in {time.monotonic() - start:.0f} s; everything is in {root}\n"
          f"see it with:\n\n  agoq dashboard --root {root}\n\nthen open http://127.0.0.1:8000/")
    return 0
