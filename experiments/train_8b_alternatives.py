"""LLaMA-3-8B (32 layers, seq 4096) on one GPU: agoq against the best alternatives a user already has.

Each configuration trains a few steps in its own process (so one running out of memory loses nothing else)
and reports its peak (torch.cuda.max_memory_allocated over the steps) and median tokens/s:

  agoq@N           agoq train --policy agoq-paper --gradients quangrad8 --optimizer adamw8bit  (float32 masters)
  agoq-nomaster@N  the same with --master none
  agoq-compiled@N  agoq with --compile (each decoder layer compiled)
  agoq-nomaster-compiled@N  both
  ckpt-8bit@N      agoq train --checkpoint-all --optimizer adamw8bit (the same fused 8-bit step, bf16 gradients)
  ckpt-quangrad-nomaster-compiled@N  agoq train --checkpoint-all --gradients quangrad8 --optimizer adamw8bit
                                 --master none --compile (every layer recomputed, 8-bit gradients)
  bf16-nomaster-compiled@N       agoq train --compile --optimizer adamw8bit --master none (bf16 activations and
                                 gradients: compiled bf16 with agoq's fused 8-bit AdamW)
  budget0.1-nomaster-compiled@N  the same with --activation-memory-budget 0.1
  budgetB-OPT@N    the model alone (agoq.models reference, bf16), each decoder layer torch.compile'd with
                   torch._functorch.config.activation_memory_budget = B, optimizer OPT = torchao (torchao.optim's
                   AdamW8bit) or bnb (bitsandbytes' AdamW8bit) or torch (fused AdamW, float32 state), clip 1.0;
                   bf16 parameters updated in place (no masters)

A suffix +offK offloads the saved tensors of decoder layers 0..K-1 to pinned host memory (agoq.runtime.activations.offload:
a side stream out in forward, fetched back ahead of use in backward, a pinned pool made once): on an agoq
configuration that is `agoq train --offload 0-(K-1)` (the packed 4-bit codes and their scales), on a budget
configuration it is the ordinary offload of what compile's partitioner saves (bf16: mostly each layer's input).

N is the micro-batch (sequences of --seq-len tokens, 4096 unless given, per step); @NxA accumulates A micro-batches per optimizer step
(agoq train configurations only). Byte-level data (tinyshakespeare) on the model's own
vocabulary of 128256 (agoq train never shrinks a model's vocabulary, so every configuration has the same
8.03 B parameters); random initial weights; AdamW betas 0.9/0.95, weight decay 0.1, lr 1e-4 everywhere.

    python experiments/train_8b_alternatives.py [--configs agoq@1,agoq@4,budget0.1-torchao@1,...] [--steps 4]
    python experiments/train_8b_alternatives.py --configs agoq-nomaster-compiled+off24@4,budget0.1-torchao+off32@8
Writes experiments/results/train_8b_alternatives.json; a configuration that fails says why in its row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402
from experiments.train_runs import run_train, summarize, tiny_shakespeare  # noqa: E402

EVERYTHING = ["--policy", "agoq-paper", "--gradients", "quangrad8", "--optimizer", "adamw8bit"]
AGOQ = {
    "agoq": EVERYTHING,
    "agoq-nomaster": EVERYTHING + ["--master", "none"],
    "agoq-compiled": EVERYTHING + ["--compile"],
    "agoq-nomaster-compiled": EVERYTHING + ["--master", "none", "--compile"],
    "ckpt-8bit": ["--checkpoint-all", "--optimizer", "adamw8bit"],
    "ckpt-quangrad-nomaster-compiled": ["--checkpoint-all", "--gradients", "quangrad8", "--optimizer", "adamw8bit",
                                        "--master", "none", "--compile"],
    "bf16-nomaster-compiled": ["--optimizer", "adamw8bit", "--master", "none", "--compile"],
    "budget0.1-nomaster-compiled": ["--activation-memory-budget", "0.1", "--optimizer", "adamw8bit", "--master", "none",
                                    "--compile"],
}
DEFAULT_CONFIGS = ("agoq@1,agoq@4,agoq-compiled@4,agoq-nomaster@8,ckpt-8bit@4,"
                   "budget0.1-torchao@1,budget0.1-torchao@4,budget0.3-torchao@1")


def _optimizer(name: str, params):
    import torch

    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "torchao":
        from torchao.optim import AdamW8bit
        return AdamW8bit(params, **kw)
    if name == "bnb":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, **kw)
    if name == "torch":
        return torch.optim.AdamW(params, fused=True, **kw)
    raise SystemExit(f"unknown optimizer {name!r}: give torchao, bnb or torch")


def alternative(budget: float, optimizer: str, micro_batch: int, steps: int, data: str, offload: int = 0,
                model_spec: str = "llama-3-8b", seq: int = 4096) -> dict:
    """Train the compiled reference model `steps` steps in this process, decoder layers 0..offload-1's saved
    tensors offloaded; returns its figures."""
    import torch
    import torch._functorch.config  # not imported by `import torch` on every version

    from agoq.runtime.activations.compile import compile_decoder_layers
    from agoq.runtime.activations.offload import apply_offload
    from agoq.models import build

    torch.backends.cuda.matmul.allow_tf32 = True
    torch._functorch.config.activation_memory_budget = budget
    model = build(model_spec, dtype=torch.bfloat16, device="cuda")
    compile_decoder_layers(model)
    offloaded = apply_offload(model, layers=range(offload))
    opt = _optimizer(optimizer, model.parameters())
    text = torch.frombuffer(bytearray(Path(data).read_bytes()), dtype=torch.uint8).to("cuda", torch.long)
    g = torch.Generator(device="cuda").manual_seed(0)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        if offloaded is not None:
            offloaded.begin_micro_batch()
        starts = torch.randint(0, text.numel() - seq - 1, (micro_batch,), device="cuda", generator=g)
        idx = starts[:, None] + torch.arange(seq + 1, device="cuda")
        window = text[idx]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {step}: loss {loss.item():.4f}, {times[-1]:.3f} s", flush=True)
    timed = times[2:] if len(times) > 2 else times
    step_s = statistics.median(timed)
    out = {"peak_bytes": torch.cuda.max_memory_allocated(), "median_step_seconds": step_s,
           "median_tokens_per_s": micro_batch * seq / step_s, "first_step_seconds": times[0],
           "step_seconds": times}
    if offloaded is not None:
        out["offload"] = offloaded.stats.to_dict()
    return out


def _split_offload(name: str) -> tuple[str, int]:
    """NAME+offK -> (NAME, K); NAME -> (NAME, 0)."""
    base, plus, tail = name.partition("+off")
    if not plus:
        return name, 0
    if not tail.isdigit() or not 1 <= int(tail) <= 32:
        raise SystemExit(f"bad offload suffix in {name!r}: +offK with K in 1..32 (the first K layers offload)")
    return base, int(tail)


def run_config(config: str, steps: int, data: str, tmp: Path, model: str = "llama-3-8b", seq: int = 4096) -> dict:
    """One configuration in its own process; its figures, or {"error": ...}."""
    name, _, split = config.partition("@")
    mb, _, accum = (split or "1").partition("x")
    micro_batch, grad_accum = int(mb), int(accum or 1)
    name, offload = _split_offload(name)
    if name in AGOQ:
        args = AGOQ[name] + (["--offload", f"0-{offload - 1}"] if offload else [])
        if grad_accum > 1:
            args += ["--grad-accum", str(grad_accum)]
        out = tmp / config.replace("@", "_")
        try:
            run_train([model, "--data", data, "--seq-len", str(seq), "--micro-batch", str(micro_batch),
                       "--steps", str(steps), "--eval-every", str(steps), "--eval-batches", "1",
                       "--checkpoint-every", "0", "--lr", "1e-4", "--quiet", *args, "--out", str(out)])
        except SystemExit as exc:
            return {"error": str(exc)[-600:], "args": args}
        s = summarize(out, skip=2)
        row = {"peak_bytes": s["peak_bytes_per_rank"][0], "median_step_seconds": s["median_step_seconds"],
               "median_tokens_per_s": s["median_tokens_per_s"], "args": args}
        run = json.loads((out / "run.json").read_text())
        if run.get("offload"):
            row["offload"] = run["offload"]
        return row
    if grad_accum > 1:
        raise SystemExit(f"{config!r}: accumulation (@NxA) is for the agoq train configurations only")
    if not name.startswith("budget") or "-" not in name:
        raise SystemExit(f"unknown configuration {config!r}: see --help")
    budget, optimizer = name[len("budget"):].split("-", 1)
    cmd = [sys.executable, __file__, "--child", json.dumps([float(budget), optimizer, micro_batch, steps, data, offload, model, seq])]
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-600:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="tinyshakespeare.txt (default: ../shared/data/)")
    ap.add_argument("--steps", type=int, default=4, help="steps per configuration; the first two are not timed")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated NAME@MICRO_BATCH (see above)")
    ap.add_argument("--model", default="llama-3-8b", help="preset or config.json (e.g. experiments/llama_3_1_8b.json, "
                    "whose RoPE scaling allows 131072 positions)")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--name", default="train_8b_alternatives", help="results file name (experiments/results/NAME.json)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(alternative(*json.loads(args.child))), flush=True)
        return
    data = tiny_shakespeare(args.data)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            t0 = time.perf_counter()
            row = run_config(config, args.steps, data, Path(tmp), args.model, args.seq_len)
            row["wall_seconds"] = time.perf_counter() - t0
            rows[config] = row
            if "error" in row:
                print(f"{config:>22s}: failed: {row['error'][-200:]}", flush=True)
            else:
                print(f"{config:>22s}: peak {row['peak_bytes'] / 1e9:6.1f} GB, {row['median_tokens_per_s']:7.0f} tokens/s",
                      flush=True)
            # rewritten after every configuration: a run cut short keeps what it measured
            path = write_result(args.name, {"model": f"{args.model} (vocab 128256)", "seq_len": args.seq_len,
                                                          "steps": args.steps, "configs": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
