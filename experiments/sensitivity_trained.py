"""Does a kind's sensitivity at fresh weights say how it behaves once the model has learnt something?

`agoq profile` measures each (layer, kind, option)'s sensitivity (the relative error of all weight gradients when
only that tensor is quantized; agoq.profiler.sensitivity) on freshly initialised weights and random tokens. On the
129 M byte LLaMA a plan whose summed sensitivity was under agoq-paper's quantized attention to 3 bits in every
layer and lost 4.7 % validation loss after 800 steps, where agoq-paper (attention kept) lost 0.85 %
(docs/results.md, "Fidelity"). Attention's softmax is nearly uniform at initialisation, so errors in q and k barely
move it then; after training they do.

This script measures the same sensitivities on a small byte LLaMA (CPU, float32) at its initial weights and after
`--steps` steps of AdamW on tinyshakespeare, on random tokens (as the profiler does) and on held-out text, for each
kind at each bit width in every layer, and writes the mean per (kind, bits) and the ratio trained / fresh.

    python experiments/sensitivity_trained.py --steps 600        # a few minutes on 2 cores
Writes experiments/results/sensitivity_trained.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agoq.models import build  # noqa: E402
from agoq.models.config import LlamaConfig  # noqa: E402
from agoq.profiler.model_source import next_token_loss, token_batches  # noqa: E402
from agoq.profiler.sensitivity import Measurement, SensitivityMeter  # noqa: E402
from experiments.record import write_result  # noqa: E402

KINDS = ("norm_input", "attention", "o_proj_input", "silu_input")


def text_batches(data: torch.Tensor, count: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - seq - 2, (batch,), generator=gen)
        out.append(torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long())
    return out


def sensitivities(model, batches, layers: int, bits: list[int]) -> dict:
    meter = SensitivityMeter(model, batches, block=128)
    out = {}
    for kind in KINDS:
        for b in bits:
            values = [meter.measure(Measurement(layer, kind, str(b), "int")) for layer in range(layers)]
            out[f"{kind}@{b}"] = sum(values) / len(values)
    meter.release()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bits", default="3,4,8")
    ap.add_argument("--name", default="sensitivity_trained")
    args = ap.parse_args()
    torch.manual_seed(0)
    bits = [int(b) for b in args.bits.split(",")]
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=max(256, args.seq_len + 1), name="byte-small")
    model = build(cfg, dtype=torch.float32, device="cpu")
    data = torch.frombuffer(bytearray(Path(args.data).read_bytes()), dtype=torch.uint8)
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]
    random_tokens = token_batches(256, 2, 2, args.seq_len, seed=0, device="cpu")
    text = text_batches(held, 2, 2, args.seq_len, seed=1)
    fresh = {"random tokens": sensitivities(model, random_tokens, args.layers, bits),
             "held-out text": sensitivities(model, text, args.layers, bits)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(2)
    started, losses = time.perf_counter(), []
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq_len - 2, (args.batch,), generator=gen)
        ids = torch.stack([train[s:s + args.seq_len + 1] for s in starts.tolist()]).long()
        loss = next_token_loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {sum(losses[-100:]) / 100:.3f}", flush=True)
    with torch.no_grad():
        val = sum(next_token_loss(model, ids).item() for ids in text_batches(held, 8, 8, args.seq_len, 3)) / 8
    trained = {"random tokens": sensitivities(model, random_tokens, args.layers, bits),
               "held-out text": sensitivities(model, text, args.layers, bits)}
    ratio = {src: {k: trained[src][k] / fresh[src][k] if fresh[src][k] > 0 else None for k in fresh[src]}
             for src in fresh}
    for src in fresh:
        print(src)
        for k in fresh[src]:
            print(f"  {k:18s} fresh {fresh[src][k]:.4f}  trained {trained[src][k]:.4f}  x{ratio[src][k]:.2f}")
    figures = {"model": {"hidden": args.hidden, "layers": args.layers, "heads": 4, "vocab": 256},
               "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
               "train_loss_last_100": sum(losses[-100:]) / min(100, len(losses)), "held_out_loss": val,
               "train_seconds": time.perf_counter() - started, "fresh": fresh, "trained": trained,
               "trained_over_fresh": ratio,
               "sensitivity": "mean over layers of agoq.profiler.sensitivity (relative L2 error of all weight "
                              "gradients), 2 batches of 2 sequences"}
    print("wrote", write_result(args.name, figures))


if __name__ == "__main__":
    main()
