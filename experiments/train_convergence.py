"""Convergence on one GPU: plain bf16 against agoq (agoq-paper activations + 8-bit gradients + fused 8-bit AdamW).

All runs train the same LLaMA (experiments/train_llama_byte.json: hidden 1024, 10 layers, 16 heads,
SwiGLU FFN 2816, byte vocabulary 256, 129 M parameters) on tinyshakespeare.txt
(bytes, 90/10 train/validation split, read from ../shared/data, never copied), sequences of 1024, same
seed, data order and schedule (AdamW betas 0.9/0.95, weight decay 0.1, warmup then cosine to lr/10,
gradient clipping 1.0, float32 master weights). The agoq runs store activations with the agoq-paper
policy, accumulate gradients in QuanGrad's 8-bit buffer and step with the fused 8-bit AdamW, once with float32
master weights (agoq) and once without (agoq-nomaster: bf16 parameters updated with stochastic rounding).
Goal: final validation loss within 1 % of bf16's, for each.

Writes experiments/results/train_convergence.json (the figures of every run, the relative differences,
the goal) and the run folders, without their checkpoints, under experiments/results/runs/
(run.json + metrics.jsonl, read by the dashboard).

GPU (one H200; about 3 x 2 minutes, or about 3 at once with --concurrent):
    python experiments/train_convergence.py [--concurrent]
CPU check (tiny model, seconds):
    python experiments/train_convergence.py --tiny
"""

from __future__ import annotations

import argparse
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
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
    parser.add_argument("--variants", default="bf16,agoq,agoq-nomaster",
                        help="comma-separated, bf16 first: bf16, agoq (float32 masters), agoq-nomaster (--master none)")
    parser.add_argument("--concurrent", action="store_true",
                        help="train the variants at the same time on one GPU (losses are unaffected; step times are "
                             "then not comparable and no time ratio is written)")
    parser.add_argument("--out", default=str(RESULTS / "runs"), help="folder for the run folders")
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
    everything = ["--policy", "agoq-paper", "--gradients", "quangrad8", "--optimizer", "adamw8bit"]
    variants = {"bf16": [], "agoq": everything + ["--master", "fp32"], "agoq-nomaster": everything + ["--master", "none"]}
    variants = {name: variants[name] for name in args.variants.split(",")}

    def one(name: str) -> tuple[str, float]:
        run_dir = Path(args.out) / f"{args.name}_{name}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        return name, run_train(common + variants[name] + ["--out", str(run_dir), "--quiet"])

    with ThreadPoolExecutor(max_workers=len(variants) if args.concurrent else 1) as pool:
        walls = dict(pool.map(one, variants))
    figures = {"runs": {}, "concurrent": args.concurrent}
    for name, extra in variants.items():
        run_dir = Path(args.out) / f"{args.name}_{name}"
        drop_checkpoint(run_dir)
        figures["runs"][name] = {**summarize(run_dir), "wall_seconds": walls[name], "extra_args": extra}
    base = figures["runs"]["bf16"]
    lines = []
    for name, run in figures["runs"].items():
        if name == "bf16":
            continue
        diff = relative_difference(run["final_val_loss"], base["final_val_loss"])
        figures[name] = {"final_val_loss_relative_difference": diff, "met": diff <= GOAL,
                         "min_val_loss_relative_difference": relative_difference(run["min_val_loss"],
                                                                                 base["min_val_loss"]),
                         "peak_bytes_ratio_over_bf16": run["peak_bytes_per_rank"][0] / base["peak_bytes_per_rank"][0]}
        if not args.concurrent:
            figures[name]["step_time_ratio_over_bf16"] = run["median_step_seconds"] / base["median_step_seconds"]
        lines.append(f"{name} {run['final_val_loss']:.4f} ({diff:.2%} apart: {'met' if diff <= GOAL else 'NOT met'})")
    figures["goal"] = GOAL
    path = write_result(args.name, figures) if args.results is None else _write_local(args, figures)
    print(f"final val loss: bf16 {base['final_val_loss']:.4f}; " + "; ".join(lines) + f"; goal <= {GOAL:.0%}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
