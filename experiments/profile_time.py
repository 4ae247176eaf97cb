"""Where the time of `agoq profile` goes: the whole command run in this process as a user runs it, with wall-clock
timers wrapped around its stages and around the parts of every measured step (agoq.train.measure.measure_steps:
the memory released between kinds, the run prepared, the trainer built, the first step, the later steps, the
trainer closed).

    python experiments/profile_time.py --name profile_time_probe -- probe --device cuda --out /tmp/p --seq-len 4096

Everything after `--` is `agoq profile`'s own arguments. Writes experiments/results/NAME.json: the profile's total
seconds, its own phase seconds (profile.json "seconds"), the stages' seconds and the step parts' (calls, seconds),
and for each measured kind its first step and its later steps. With --whole-process the command runs as a process
of its own and only its wall clock is taken (interpreter start-up and imports included).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.record import write_result  # noqa: E402

TIMERS: dict[str, list[float]] = {}


def _timed(owner, attribute: str, label: str, sync: bool = False) -> None:
    """Replace owner.attribute by a wrapper that adds each call's wall seconds to TIMERS[label]."""
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        import torch

        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            TIMERS.setdefault(label, []).append(time.perf_counter() - start)

    setattr(owner, attribute, wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="profile_time")
    parser.add_argument("--whole-process", action="store_true",
                        help="time `python -m agoq.cli profile ...` as a process of its own, start-up and imports "
                             "included, as a user meets it (no stage timers)")
    parser.add_argument("profile_args", nargs=argparse.REMAINDER, help="-- then agoq profile's arguments")
    args = parser.parse_args()
    profile_args = [a for a in args.profile_args if a != "--"]
    if args.whole_process:
        import subprocess

        start = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "agoq.cli", "profile", *profile_args]).returncode
        total = time.perf_counter() - start
        print(f"total {total:.1f} s (whole process)")
        figures = {"exit_code": code, "total_seconds": total, "whole_process": True, "profile_args": profile_args}
        print(f"wrote {write_result(args.name, figures)}")
        return code

    import agoq.commands.profile as profile_command
    import agoq.commands.profile_layouts as layouts
    import agoq.commands.profile_steps as steps
    import agoq.profiler.profile as profiler
    import agoq.train.measure as measure
    from agoq.cli import main as agoq_main

    _timed(profiler, "make_profile", "stage: make_profile (layer table, sensitivities, memory)")
    _timed(steps, "measure_profile_steps", "stage: measured steps")
    _timed(layouts, "measure_layout_steps", "stage: layout steps")
    _timed(profile_command, "collective_kernels_stage", "stage: collective kernels")
    import agoq.profiler.replay as replay
    import agoq.profiler.sensitivity as sensitivity

    _timed(replay.ReplaySession, "__init__", "sensitivity: replay session (reference forward, dy)", sync=True)
    _timed(replay.ReplaySession, "noise_floor", "sensitivity: noise floors (nothing substituted)")
    _timed(replay.ReplaySession, "_reference", "sensitivity: reference partials", sync=True)
    _timed(replay.ReplaySession, "error", "sensitivity: replays (incl. their reference partials)")
    _timed(sensitivity, "_measured_bytes", "sensitivity: bytes measured (forwards with options)", sync=True)
    _timed(sensitivity.SensitivityMeter, "measure", "sensitivity: policy runs", sync=True)
    _timed(profiler, "_tensor_errors", "stage: tensor errors", sync=True)
    _timed(measure, "measure_steps", "kind: whole measure_steps")
    _timed(measure, "_release_memory", "kind: release memory (gc, dynamo reset, empty_cache)")
    _timed(measure, "prepare", "kind: prepare (data, model, plan applied)")
    _timed(measure.Trainer, "__init__", "kind: Trainer()")
    _timed(measure.Trainer, "close", "kind: Trainer.close")
    original_step = measure.Trainer.step

    def step(self, index: int):
        start = time.perf_counter()
        try:
            return original_step(self, index)
        finally:
            TIMERS.setdefault("kind: first step" if index == 0 else "kind: later steps", []).append(
                time.perf_counter() - start)

    measure.Trainer.step = step

    start = time.perf_counter()
    code = agoq_main(["profile", *profile_args])
    total = time.perf_counter() - start

    out = Path(profile_args[profile_args.index("--out") + 1]) if "--out" in profile_args else None
    header = json.loads((out / "profile.json").read_text()) if out and (out / "profile.json").is_file() else {}
    figures = {"exit_code": code, "total_seconds": total, "profile_args": profile_args,
               "profile_phase_seconds": header.get("seconds"),
               "timers": {label: {"calls": len(v), "seconds": sum(v)} for label, v in TIMERS.items()},
               "measured_kinds": len((header.get("measured_steps") or {}).get("rows") or []),
               "layout_steps": len((header.get("layout_steps") or {}).get("rows") or [])}
    for label, value in figures["timers"].items():
        print(f"{label:60s} {value['calls']:4d} calls {value['seconds']:8.1f} s")
    print(f"total {total:.1f} s")
    path = write_result(args.name, figures)
    print(f"wrote {path}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
