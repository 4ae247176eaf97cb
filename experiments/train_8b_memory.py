"""LLaMA-3-8B (all 32 layers, seq 4096, micro-batch 1) trained on one GPU: peak memory and step time.

  agoq            --policy agoq-paper --gradients quangrad8 --optimizer adamw8bit   (float32 masters)
  agoq-nomaster   the same with --master none (bf16 parameters, stochastic rounding)
  ckpt-8bit-adam  --checkpoint-all --optimizer adamw8bit  (bf16 gradients; the same fused 8-bit step)

Byte-level data (tinyshakespeare) on the model's own vocabulary of 128256 (agoq train only ever widens a
vocabulary, never narrows it: 8.03 B parameters); weights are random. A few steps each: the figures are the peak bytes over the steps
(torch.cuda.max_memory_allocated) and the median step time. Targets (issue: memory where it counts):
peak <= 85 GB with float32 masters and <= 60 GB without.

    python experiments/train_8b_memory.py [--steps 3] [--variants agoq,agoq-nomaster,ckpt-8bit-adam]
Writes experiments/results/train_8b_memory.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402
from experiments.train_runs import run_train, summarize, tiny_shakespeare  # noqa: E402

VARIANTS = {
    "agoq": ["--policy", "agoq-paper", "--gradients", "quangrad8", "--optimizer", "adamw8bit"],
    "agoq-nomaster": ["--policy", "agoq-paper", "--gradients", "quangrad8", "--optimizer", "adamw8bit",
                      "--master", "none"],
    "ckpt-8bit-adam": ["--checkpoint-all", "--optimizer", "adamw8bit"],
}
TARGETS_GB = {"agoq": 85.0, "agoq-nomaster": 60.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    data = tiny_shakespeare(args.data)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            out = Path(tmp) / name
            run_train(["llama-3-8b", "--data", data, "--seq-len", "4096", "--micro-batch", "1",
                       "--steps", str(args.steps), "--eval-every", str(args.steps), "--eval-batches", "1",
                       "--checkpoint-every", "0", "--lr", "1e-4", "--quiet", *VARIANTS[name], "--out", str(out)])
            s = summarize(out, skip=1)
            peak = s["peak_bytes_per_rank"][0]
            rows[name] = {"peak_bytes": peak, "peak_gb": peak / 1e9, "median_step_seconds": s["median_step_seconds"],
                          "median_tokens_per_s": s["median_tokens_per_s"], "args": VARIANTS[name],
                          "target_peak_gb": TARGETS_GB.get(name)}
            print(f"{name:>15s}: peak {peak / 1e9:.1f} GB, step {s['median_step_seconds']:.3f} s, "
                  f"{s['median_tokens_per_s']:.0f} tokens/s", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    print("wrote", write_result("train_8b_memory", {"model": "llama-3-8b (vocab 128256)", "seq_len": 4096,
                                                    "micro_batch": 1, "steps": args.steps, "variants": rows}))


if __name__ == "__main__":
    main()
