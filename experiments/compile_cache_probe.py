"""Why a compiled kind of step `agoq profile` measures compiles again: each compiled kind's first step (dynamo, AOT
autograd, inductor), AOT autograd's cache counters and the reasons it gave for bypassing its cache, and what the
memory release between kinds costs (gc.collect, torch._dynamo.reset, torch.cuda.empty_cache, timed apart).

    python experiments/compile_cache_probe.py --name compile_cache_probe [--steps 2]

Run it with a fresh TORCHINDUCTOR_CACHE_DIR, and once more with TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=1
to see what allowing custom autograd functions into AOT autograd's cache changes.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments.record import write_result  # noqa: E402

KINDS = (  # (policy, micro-batch, accumulation, offload_layers): compiled, bf16 gradients, adamw8bit, fp32 masters
    ("bf16", 2, 1, None), ("agoq-paper", 2, 1, None), ("agoq-paper", 2, 2, None), ("agoq-paper", 1, 1, None),
    ("checkpoint-all", 2, 1, None), ("checkpoint-all", 2, 2, None), ("agoq-paper", 2, 1, "offload"))


class _Reasons(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if "Bypassing" in text:
            self.reasons.append(text[:400])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="compile_cache_probe")
    parser.add_argument("--model", default="probe")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--offload-layers", type=int, default=15, help="layers the offloading kind offloads")
    args = parser.parse_args()

    import torch
    from torch._dynamo.utils import counters

    from agoq.commands.profile_steps import BASE, train_settings
    from agoq.train.config import TrainConfig
    from agoq.train.measure import measure_steps

    handler = _Reasons()
    for name in ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    rows = []
    for policy, micro_batch, accum, offload in KINDS:
        if offload:
            if args.device == "cpu":
                continue
            offload = args.offload_layers
        kind = {"compile": "compiled", "policy": policy, "micro_batch": micro_batch, "grad_accum": accum, **BASE,
                "activation_memory_budget": None, "offload_layers": offload}
        before = dict(counters["aot_autograd"])
        handler.reasons.clear()
        figures = measure_steps(TrainConfig(**train_settings(kind, args.model, args.seq_len, args.dtype, args.device,
                                                              args.steps, 0)))
        after = dict(counters["aot_autograd"])
        parts = {}
        for label, fn in (("gc_collect", gc.collect), ("dynamo_reset", torch._dynamo.reset),
                          ("empty_cache", torch.cuda.empty_cache), ("gc_collect_again", gc.collect)):
            start = time.perf_counter()
            fn()
            parts[label] = time.perf_counter() - start
        row = {"policy": policy, "micro_batch": micro_batch, "grad_accum": accum, "offload_layers": offload,
               "first_step_seconds": figures.seconds[0], "losses": figures.losses, "step_seconds": figures.median_seconds,
               "aot_autograd": {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)},
               "bypass_reasons": sorted(set(handler.reasons))[:5], "release_seconds": parts,
               "gc_objects": len(gc.get_objects())}
        rows.append(row)
        print(f"{policy:15s} {micro_batch}x{accum} offload={offload}: first {row['first_step_seconds']:.2f} s, "
              f"step {row['step_seconds'] * 1e3:.1f} ms, aot {row['aot_autograd']}, release "
              + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + f", objects {row['gc_objects']}")
        for reason in row["bypass_reasons"]:
            print("   bypass:", reason[:300])
    flag = os.environ.get("TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD", "")
    path = write_result(args.name, {"allow_custom_autograd": flag, "rows": rows, "model": args.model,
                                    "seq_len": args.seq_len, "steps": args.steps})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
