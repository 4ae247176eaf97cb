"""The training step with everything agoq on against plain bf16, on one GPU, in one run.

The 129 M byte-level LLaMA (experiments/train_llama_byte.json), micro-batch 4 x 1024 tokens, tinyshakespeare:

  bf16            --optimizer adamw (torch's AdamW on float32 masters), bf16 gradients, nothing quantized
  bf16-8bit-adam  bf16 gradients, 8-bit AdamW (fused step)
  agoq            --policy agoq-paper --gradients quangrad8 --optimizer adamw8bit (fused step, QuanGrad read
                  in place), float32 masters
  agoq-nomaster   the same with --master none (bf16 parameters, stochastic rounding)

Each variant runs in every mode of `--modes` (eager: --no-compile; compiled: --compile, torch.compile per
decoder layer in mode default; graphs: --compile --compile-mode reduce-overhead, each compiled layer replayed as
a CUDA graph). The reference is the fastest bf16 mode of the run: a ratio "x best bf16" compares every run with
it, so agoq is never judged against a slower bf16 than a user would pick.

Each run trains `--steps` steps (validation once at the end); the figures are the median step time and
tokens/s over the steps after the first 10, and the peak bytes (torch.cuda.max_memory_allocated). Target
(issue: memory where it counts): agoq <= 1.05x the bf16 step.

    python experiments/train_step_overhead.py                     # ~2-3 minutes on an H200
    python experiments/train_step_overhead.py --tiny --steps 6    # CPU check
    python experiments/train_step_overhead.py --modes compiled,graphs --variants bf16,agoq,agoq-nomaster
Writes experiments/results/train_step_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402
from experiments.train_runs import BYTE_MODEL, run_train, summarize, tiny_shakespeare  # noqa: E402

MODES = {"eager": ["--no-compile"], "compiled": ["--compile"],
         "graphs": ["--compile", "--compile-mode", "reduce-overhead"]}
VARIANTS = {
    "bf16": ["--optimizer", "adamw"],
    "bf16-8bit-adam": ["--optimizer", "adamw8bit"],
    "agoq": ["--policy", "agoq-paper", "--gradients", "quangrad8", "--optimizer", "adamw8bit"],
    "agoq-nomaster": ["--policy", "agoq-paper", "--gradients", "quangrad8", "--optimizer", "adamw8bit",
                      "--master", "none"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="text file (default: tinyshakespeare.txt from shared/data)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--modes", default="eager", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the whole list this many times, alternating its order; each run's figure is the median "
                         "over its repeats (a GPU shared with other work varies from minute to minute)")
    ap.add_argument("--extra", default="", help="extra arguments for every run, e.g. '--compile'")
    ap.add_argument("--tiny", action="store_true", help="llama-tiny on the CPU (a check that it runs)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    for name in [*modes, *args.variants.split(",")]:
        if name not in MODES and name not in VARIANTS:
            ap.error(f"unknown mode or variant {name!r}: modes {', '.join(MODES)}; variants {', '.join(VARIANTS)}")
    data = tiny_shakespeare(args.data)
    model = "llama-tiny" if args.tiny else str(BYTE_MODEL)
    shape = ["--seq-len", str(min(args.seq_len, 64) if args.tiny else args.seq_len),
             "--micro-batch", str(args.micro_batch)]
    common = [model, "--data", data, "--steps", str(args.steps), "--eval-every", str(args.steps),
              "--eval-batches", "4", "--checkpoint-every", "0", "--lr", "1e-3", "--quiet", *shape,
              *(["--device", "cpu"] if args.tiny else []), *args.extra.split()]
    rows = {}
    runs = [(mode, variant) for mode in modes for variant in args.variants.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            # repeats alternate the order, so that a slow spell of a shared GPU does not fall on one variant only
            for mode, variant in (runs if repeat % 2 == 0 else runs[::-1]):
                name = variant if modes == ["eager"] else f"{variant} @ {mode}"
                flags = [*VARIANTS[variant], *MODES[mode]]
                out = Path(tmp) / name.replace(" @ ", "-")
                run_train([*common, *flags, "--out", str(out)])
                s = summarize(out)
                row = rows.setdefault(name, {"variant": variant, "mode": mode, "args": flags, "repeats": []})
                row["repeats"].append({"median_step_seconds": s["median_step_seconds"],
                                       "median_tokens_per_s": s["median_tokens_per_s"],
                                       "peak_bytes": s["peak_bytes_per_rank"][0] if s["peak_bytes_per_rank"] else None,
                                       "final_val_loss": s["final_val_loss"]})
                shutil.rmtree(out, ignore_errors=True)
    for row in rows.values():  # the median over repeats of each run's median step (repeats 1: that run's figures)
        reps = sorted(row["repeats"], key=lambda r: r["median_step_seconds"] or float("inf"))
        row.update(reps[(len(reps) - 1) // 2])
        if args.repeats == 1:
            del row["repeats"]
    bf16 = [r for r in rows.values() if r["variant"] == "bf16" and r["median_step_seconds"]]
    base = min(bf16, key=lambda r: r["median_step_seconds"]) if bf16 else None
    for r in rows.values():
        if base and r["median_step_seconds"]:
            r["step_vs_best_bf16"] = r["median_step_seconds"] / base["median_step_seconds"]
            if base["peak_bytes"] and r["peak_bytes"]:
                r["peak_vs_best_bf16"] = r["peak_bytes"] / base["peak_bytes"]
    print(f"{'run':>26s} {'step ms':>9s} {'x best bf16':>12s} {'peak GB':>8s} {'x best bf16':>12s} {'val loss':>9s}")
    for name, r in rows.items():
        print(f"{name:>26s} {r['median_step_seconds'] * 1e3:9.2f} {r.get('step_vs_best_bf16', float('nan')):12.3f} "
              f"{(r['peak_bytes'] or 0) / 1e9:8.3f} {r.get('peak_vs_best_bf16', float('nan')):12.3f} "
              f"{r['final_val_loss'] or float('nan'):9.4f}")
    figures = {"model": "llama-tiny" if args.tiny else json.loads(BYTE_MODEL.read_text())["name"],
               "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps, "modes": modes,
               "repeats": args.repeats,
               "extra": args.extra, "variants": rows, "best_bf16": base and f"bf16 @ {base['mode']}",
               "target_agoq_step_vs_bf16": 1.05}
    if not args.tiny:
        suffix = ("" if modes == ["eager"] else "_" + "_".join(modes)) + (f"_x{args.repeats}" if args.repeats > 1 else "")
        print("wrote", write_result(f"train_step_overhead{suffix}", figures))


if __name__ == "__main__":
    main()
