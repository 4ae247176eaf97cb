"""Convergence on one GPU: plain bf16 against agoq (agoq-paper activations + 8-bit gradients + 8-bit AdamW).

Both runs train the same LLaMA (experiments/train_llama_byte.json: hidden 1024, 10 layers, 16 heads,
SwiGLU FFN 2816, byte vocabulary 256, 129 M parameters) on tinyshakespeare.txt
(bytes, 90/10 train/validation split, read from ../shared/data, never copied), sequences of 1024, same
seed, data order and schedule (AdamW betas 0.9/0.95, weight decay 0.1, warmup then cosine to lr/10,
gradient clipping 1.0, float32 master weights). The second run stores activations with the agoq-paper
policy, accumulates gradients in QuanGrad's 8-bit buffer and keeps AdamW's moments in 8 bits.
Goal: final validation loss within 1 % of bf16's.

Writes experiments/results/train_convergence.json (the figures of both runs, the relative difference,
the goal) and the two run folders, without their checkpoints, under experiments/results/runs/
(run.json + metrics.jsonl, read by the dashboard).

GPU (one H200; about 2 x 3 minutes):
    python experiments/train_convergence.py
CPU check (tiny model, seconds):
    python experiments/train_convergence.py --tiny
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import RESULTS, write_result  # noqa: E402
from experiments.train_runs import (  # noqa: E402
    BYTE_MODEL,
    drop_checkpoint,
    relative_difference,
    run_train,
    summarize,
    tiny_shakespeare,
)

GOAL = 0.01  # final validation loss within 1 % of the bf16 run's


def _write_local(args, figures) -> Path:
    import json

    path = Path(args.results) / f"{args.name}.json"
    path.write_text(json.dumps(figures, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per run (default 2000)")
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="sequences per step (default 4 x 1024 tokens: 2000 steps are 8 passes over the 1 MB "
                             "of training text, where a 128 M model already overfits)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=16, help="validation micro-batches (default 16: "
                                                                       "64 of the 108 validation sequences)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--tiny", action="store_true", help="CPU check: llama-tiny, 40 steps, sequences of 128")
    parser.add_argument("--out", default=str(RESULTS / "runs"), help="folder for the two run folders")
    parser.add_argument("--name", default="train_convergence", help="result file name (default train_convergence)")
    args = parser.parse_args(argv)
    args.results = None

    model = str(BYTE_MODEL)
    if args.tiny:
        model, args.steps, args.seq_len, args.micro_batch, args.eval_every = "llama-tiny", 40, 128, 4, 10
        args.warmup, args.eval_batches, args.name = 5, 2, args.name + "_tiny"
        args.out = args.out if args.out != str(RESULTS / "runs") else "/tmp/agoq-train-convergence"
        args.results = args.out
    data = tiny_shakespeare(args.data)
    common = [model, "--data", data, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
              "--steps", str(args.steps), "--lr", str(args.lr), "--warmup", str(args.warmup),
              "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
              "--checkpoint-every", "0", "--seed", "0"]
    if args.device:
        common += ["--device", args.device]
    variants = {"bf16": [],
                "agoq": ["--policy", "agoq-paper", "--gradients", "quangrad8", "--optimizer", "adamw8bit"]}
    figures = {"runs": {}}
    for name, extra in variants.items():
        run_dir = Path(args.out) / f"{args.name}_{name}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        wall = run_train(common + extra + ["--out", str(run_dir), "--quiet"])
        drop_checkpoint(run_dir)
        figures["runs"][name] = {**summarize(run_dir), "wall_seconds": wall, "extra_args": extra}
    base, agoq = figures["runs"]["bf16"], figures["runs"]["agoq"]
    diff = relative_difference(agoq["final_val_loss"], base["final_val_loss"])
    figures.update(final_val_loss_relative_difference=diff, goal=GOAL, met=diff <= GOAL,
                   step_time_ratio_agoq_over_bf16=agoq["median_step_seconds"] / base["median_step_seconds"],
                   peak_bytes_ratio_agoq_over_bf16=agoq["peak_bytes_per_rank"][0] / base["peak_bytes_per_rank"][0])
    path = write_result(args.name, figures) if args.results is None else _write_local(args, figures)
    print(f"final val loss: bf16 {base['final_val_loss']:.4f}, agoq {agoq['final_val_loss']:.4f} "
          f"({diff:.2%} apart, goal <= {GOAL:.0%}: {'met' if diff <= GOAL else 'NOT met'}); step "
          f"{base['median_step_seconds'] * 1e3:.1f} ms vs {agoq['median_step_seconds'] * 1e3:.1f} ms; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
