"""Where a training run's GPU memory goes: allocated bytes around each phase of the first steps of `agoq train`.

Wraps the trainer's phases (forward+backward of every micro-batch, the gradients handed to the optimizer, the
clip norm, the optimizer step, validation) and records for each: bytes allocated before, the peak while it
ran (torch.cuda.max_memory_allocated after a reset at its start), and bytes allocated after. The bytes
allocated before the first step are what the run keeps whatever it does (weights, optimizer state,
gradient buffers). The run's own arguments follow `--`:

    python experiments/memory_phases.py --name NAME -- llama-3-8b --data D --seq-len 4096 --micro-batch 1 \
        --steps 2 --policy agoq-paper --gradients quangrad8 --optimizer adamw8bit --checkpoint-every 0 --out O

Writes experiments/results/NAME.json.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402

PHASES = ("_forward_backward", "_gradients", "_grad_norm", "_apply", "evaluate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="result file name")
    ap.add_argument("--max-records", type=int, default=12, help="phases recorded (default 12: about two steps)")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then agoq train's arguments")
    args = ap.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not torch.cuda.is_available():
        raise SystemExit("memory_phases measures CUDA allocations: run it on a GPU")

    from agoq.train import trainer
    from agoq.train.__main__ import main as train_main

    records: list[dict] = []

    def wrap(name):
        original = getattr(trainer.Trainer, name)

        @functools.wraps(original)
        def measured(self, *a, **kw):
            if len(records) >= args.max_records:
                return original(self, *a, **kw)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = original(self, *a, **kw)
            torch.cuda.synchronize()
            records.append({"phase": name.lstrip("_"), "allocated_before": before,
                            "peak": torch.cuda.max_memory_allocated(), "allocated_after": torch.cuda.memory_allocated()})
            r = records[-1]
            print(f"{r['phase']:>17s}: before {before / 1e9:7.2f} GB, peak {r['peak'] / 1e9:7.2f} GB "
                  f"(+{(r['peak'] - before) / 1e9:6.2f}), after {r['allocated_after'] / 1e9:7.2f} GB", flush=True)
            return out

        setattr(trainer.Trainer, name, measured)

    for name in PHASES:
        wrap(name)
    code = train_main(train_args)
    print("wrote", write_result(args.name, {"train_args": train_args, "exit_code": code, "phases": records}))


if __name__ == "__main__":
    main()
