"""Host offload against the ordinary ways to fit activations, each trained through `agoq train` in the same run.

Every configuration is compiled (torch.compile per decoder layer) with 8-bit AdamW on float32 masters, the probe
(1.1 B, 16 layers) at micro-batch 2 x 4096 tokens of tinyshakespeare by default, and trains `--steps` steps; the
figures are the median step of the second half and the largest peak of any step (torch.cuda.max_memory_allocated:
weights, masters, gradients, optimizer state and activations), and the largest reserved peak (what the allocator
held, blocks waiting for offload's copies included).

Configurations (--configs, comma-separated; K is a number of layers, the first K are offloaded):
  bf16                compiled bf16, every activation kept: the floor
  budget-0.5 / 0.1    compile's activation_memory_budget
  checkpoint-all      every layer recomputed in backward
  checkpoint-all+offload   the same, each layer's input (all it keeps) offloaded
  bf16+offloadK       bf16 activations of layers 0..K-1 offloaded (ordinary offload: side stream, pinned pool)
  agoq                the agoq-paper policy (about 4-bit activations), kept on the GPU
  agoq+offloadK       the same, layers 0..K-1's packed codes offloaded
--extra adds agoq train flags to every configuration (e.g. QuanGrad and accumulation).

    python experiments/bench_offload.py --configs bf16,checkpoint-all,agoq,agoq+offload6   # one H200, ~5 min
    python experiments/bench_offload.py --tiny --steps 4 --configs bf16,agoq+offload1     # CPU check
Writes experiments/results/NAME.json (--name, default bench_offload).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402
from experiments.train_runs import common_args, read_metrics, run_train, summarize, tiny_shakespeare  # noqa: E402

FIXED = {"bf16": [], "budget-0.5": ["--activation-memory-budget", "0.5"],
         "budget-0.1": ["--activation-memory-budget", "0.1"], "checkpoint-all": ["--checkpoint-all"],
         "checkpoint-all+offload": ["--checkpoint-all", "--offload", "all"], "agoq": ["--policy", "agoq-paper"]}


def flags(name: str) -> list[str]:
    """agoq train's flags of configuration `name` (see the module docstring)."""
    if name in FIXED:
        return FIXED[name]
    found = re.fullmatch(r"(bf16|agoq)\+offload(\d+)", name)
    if not found:
        raise SystemExit(f"unknown configuration {name!r}: one of {sorted(FIXED)} or bf16+offloadK / agoq+offloadK")
    base, k = found.group(1), int(found.group(2))
    return FIXED[base] + ["--offload", f"0-{k - 1}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="probe")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--configs", default="bf16,budget-0.1,checkpoint-all,checkpoint-all+offload,bf16+offload3,agoq,"
                                         "agoq+offload4,agoq+offload8")
    ap.add_argument("--optimizer", default="adamw8bit", choices=["adamw", "adamw8bit"])
    ap.add_argument("--data", default=None)
    ap.add_argument("--extra", default="", help="agoq train flags added to every configuration, e.g. "
                                                 "'--gradients quangrad8 --grad-accum 4'")
    ap.add_argument("--tiny", action="store_true", help="llama-tiny on the CPU, eager, seq 64 (a check of the script)")
    ap.add_argument("--name", default="bench_offload")
    args = ap.parse_args()
    model, seq_len, micro_batch = args.model, args.seq_len, args.micro_batch
    device = ["--compile"]
    if args.tiny:
        model, seq_len, micro_batch, device = "llama-tiny", 64, 2, ["--device", "cpu", "--no-compile"]
    common = common_args(model, tiny_shakespeare(args.data), seq_len=seq_len, micro_batch=micro_batch,
                         steps=args.steps, lr=3e-4, eval_every=args.steps, eval_batches=1, device=device)
    common += ["--optimizer", args.optimizer, *args.extra.split()]
    figures = {"model": model, "micro_batch": micro_batch, "seq_len": seq_len, "steps": args.steps,
               "optimizer": args.optimizer, "extra": args.extra.split(), "configs": {}}
    work = Path(tempfile.mkdtemp(prefix="bench_offload_"))
    for name in args.configs.split(","):
        run_dir = work / name.replace("+", "_")
        extra = flags(name)
        try:
            wall = run_train(common + extra + ["--out", str(run_dir)], log=work / f"{name}.log")
        except SystemExit as e:
            figures["configs"][name] = {"flags": extra, "error": str(e)[-3000:]}
            print(f"{name}: failed\n{str(e)[-1500:]}", flush=True)
            write_result(args.name, figures)
            continue
        got = summarize(run_dir, skip=args.steps // 2)
        run = json.loads((run_dir / "run.json").read_text())
        entry = {"flags": extra, "median_step_seconds": got["median_step_seconds"],
                 "tokens_per_s": got["median_tokens_per_s"], "peak_bytes": got["peak_bytes_per_rank"][0],
                 "final_val_loss": got["final_val_loss"], "wall_seconds": wall, "offload": run.get("offload"),
                 "peak_reserved_bytes": max((m.get("peak_reserved_bytes") or 0) for m in read_metrics(run_dir)[0])
                 or None}
        figures["configs"][name] = entry
        off = entry["offload"] or {}
        print(f"{name}: {entry['median_step_seconds'] * 1e3:.1f} ms, peak {entry['peak_bytes'] / 1e9:.3f} GB"
              + (f", offloaded {sum(off.get('bytes_per_layer', {}).values()) / 1e9:.3f} GB per micro-batch, "
                 f"waited for {off.get('fetched_on_demand')} layers" if off else ""), flush=True)
        write_result(args.name, figures)
    ranked = {k: v for k, v in figures["configs"].items() if "error" not in v}
    if "bf16" in ranked:
        for v in ranked.values():
            v["step_vs_bf16"] = v["median_step_seconds"] / ranked["bf16"]["median_step_seconds"]
    write_result(args.name, figures)


if __name__ == "__main__":
    main()
