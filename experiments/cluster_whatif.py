"""The what-if checked against measurement: from the probe's 2-GPU sockets profile
(experiments/results/profiles/probe-2gpu-sockets), agoq's predictions for the probe's 4-GPU runs over NCCL's
socket transport (4 ranks, one host) beside their measured step times, and the predictions for 2 nodes of 2 (not
measured yet); writes experiments/results/cluster_whatif.json (docs/results.md, "What-if against 4 GPUs").

Each layout as the runs trained it (`agoq train` under torchrun, probe, micro-batch 2 x 4096 tokens per rank, no
activation quantization, AdamW with float32 masters, compiled for DDP and eager otherwise; agoq's own sharded
step, retired, is no longer priced: the committed cluster_whatif.json keeps its rows), priced by the one price
(agoq.search.price) on the profile re-targeted to 4 ranks
(agoq.search.whatif; the profile's own link, fitted to its collectives). The measured step times are those of
/work/shared/DESIGN.md section 4.3 (2026-11-28, `experiments/train_fsdp.py` and `train_multi_gpu.py`-style runs;
their result files are not in this repository), also predicted at 2 ranks, the profile's own world.

    python experiments/cluster_whatif.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agoq.formats.profile import load_profile  # noqa: E402
from agoq.search.price import Configuration, price  # noqa: E402
from agoq.search.problem import ProblemSettings  # noqa: E402
from agoq.search.whatif import retarget  # noqa: E402

PROFILE = ROOT / "experiments" / "results" / "profiles" / "probe-2gpu-sockets"
TOKENS_PER_RANK = 2 * 4096
# name: (layout, gradients, optimizer, compile, measured ms on 2 GPUs, on 4 GPUs) (DESIGN.md 4.3, sockets)
RUNS = {
    "ddp_bf16": ("replicated", "bf16", "adamw", "compiled", 642, 1117),
    "ddp_quangrad8": ("replicated", "quangrad8", "adamw", "compiled", 410, 804),
    "fsdp_bf16": ("fsdp", "bf16", "adamw", "eager", 949, 1794),
    "fsdp_tlqhs": ("fsdp", "sdp4bit", "adamw", "eager", 832, 1358),
}


def predicted(profile, world: int, node_size: int, layout: str, gradients: str, optimizer: str, compile_mode: str):
    target, _ = retarget(profile, world, node_size)
    knobs = ProblemSettings(layout=layout, gradient_mode=gradients, optimizer=optimizer, master="fp32",
                            compile_mode=compile_mode, micro_batch=2, grad_accum=1)
    return price(target, Configuration(knobs))


def main() -> int:
    profile = load_profile(PROFILE)
    rows = []
    for world, node_size, setting in ((2, 2, "2 ranks, sockets (the profile's world)"),
                                      (4, 4, "4 ranks, sockets, one host"), (4, 2, "4 ranks as 2 nodes of 2")):
        for name, (layout, gradients, optimizer, compile_mode, ms2, ms4) in RUNS.items():
            p = predicted(profile, world, node_size, layout, gradients, optimizer, compile_mode)
            measured_ms = {2: ms2, 4: ms4}[world] if node_size == world else None
            row = {"name": f"{name} @ {setting}", "layout": layout, "gradients": gradients, "world_size": world,
                   "node_size": node_size, "predicted_step_seconds": p.step_seconds,
                   "predicted_communication_seconds": p.communication_seconds,
                   "predicted_tokens_per_second": world * TOKENS_PER_RANK / p.step_seconds,
                   "measured_step_seconds": None if measured_ms is None else measured_ms / 1e3,
                   "measured_tokens_per_second": None if measured_ms is None
                   else world * TOKENS_PER_RANK / (measured_ms / 1e3)}
            if measured_ms is not None:
                row["relative_error"] = row["predicted_tokens_per_second"] / row["measured_tokens_per_second"] - 1
            rows.append(row)
    print(f"{'run':55} {'predicted tok/s':>16} {'measured tok/s':>15} {'error':>7}")
    for r in rows:
        m = r["measured_tokens_per_second"]
        print(f"{r['name']:55} {r['predicted_tokens_per_second']:>16,.0f} "
              f"{(f'{m:,.0f}' if m else 'not measured'):>15} "
              f"{(format(r['relative_error'], '+.1%') if m else ''):>7}")
    from experiments.record import write_result

    path = write_result("cluster_whatif", {"profile": str(PROFILE.relative_to(ROOT)),
                                           "measured_source": "DESIGN.md 4.3 (step times, sockets, 2026-11-28)",
                                           "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
