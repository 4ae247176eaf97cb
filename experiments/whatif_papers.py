"""agoq's what-if (agoq search --world-size N) for the setups SDP4Bit, AGoQ and ZeRO++ report, beside their own
speed-ups; writes experiments/results/whatif_papers.json (docs/results.md, "What-if: the papers' clusters").

From a shipped profile (default: the probe's 2-GPU sockets profile, experiments/results/profiles/probe-2gpu-sockets,
whose collectives give the quantized paths' kernel seconds) every setup is re-targeted to the paper's GPU count and
a network (agoq.search.network_spec presets, or figures; which of them the paper states is said per row), and
priced by the search's one price. The compute is the probe's (953M parameters, 2 x 4096 tokens per rank), not the
papers' models: to first order a step's compute and its gradient/weight traffic both grow with the parameters, so
the ratio that sets a speed-up depends on tokens per rank and the network more than on the model; the rows say so.

  AGoQ      QuanGrad's 8-bit all-reduce of a 32 MB (float32) gradient on 64 A6000 (8 nodes of 8, PCIe inside) at
            200 Gb/s and 10 Gb/s per node, against NCCL's all-reduce (fp32 and bf16): a collective, not a step
  SDP4Bit   128 H800 (16 nodes of 8): FSDP2 with TLq-HS gradients and agoq's int4 weight all-gather (agoq's
            sharded layout since its own sharded step, TLq-HS + qWD, was retired; qWD sends each weight's 4-bit
            difference once per step where FSDP2 gathers 4-bit weights twice) against FSDP2 in bf16
  ZeRO++    384 GPUs (24 nodes of 16): FSDP2 with TLq-HS gradients and agoq's int8 weight all-gather (qwZ's
            analogue; hpZ's secondary shard is not modelled) against FSDP2 in bf16 (ZeRO-3)

    python experiments/whatif_papers.py [--profile DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agoq.formats.profile import load_profile  # noqa: E402
from agoq.search.collective_times import collective_seconds  # noqa: E402
from agoq.search.network_spec import parse_network  # noqa: E402
from agoq.search.whatif import retarget  # noqa: E402
from agoq.search.whatif_sweep import plan_row  # noqa: E402

PROFILE = ROOT / "experiments" / "results" / "profiles" / "probe-2gpu-sockets"
GB = 10**9


def agoq_allreduce(profile, network: str, label: str, reported: float, stated: str) -> dict:
    """QuanGrad's all-reduce of 32 MB on 64 ranks in nodes of 8 against NCCL's fp32 and bf16 ones."""
    target, whatif = retarget(profile, 64, 8, network)
    size = 32 * 2**20
    t = {path: collective_seconds(target.collectives, path, size, ("all_reduce",))
         for path in ("nccl-fp32", "nccl-bf16", "quangrad8")}
    return {"paper": "AGoQ", "setup": f"all-reduce of 32 MB on 64 A6000, {label}", "gpus": 64, "node_size": 8,
            "network": whatif.network.describe(), "network_stated": stated, "reported_speedup": reported,
            "baseline": "NCCL all-reduce, fp32 (bf16 beside it)", "variant": "QuanGrad 8-bit all-reduce",
            "baseline_seconds": t["nccl-fp32"], "variant_seconds": t["quangrad8"],
            "agoq_speedup": t["nccl-fp32"] / t["quangrad8"], "agoq_speedup_vs_bf16": t["nccl-bf16"] / t["quangrad8"],
            "seconds": t, "kind": "collective"}


def fsdp_step(profile, paper: str, gpus: int, node: int, network: str, label: str, stated: str, budget: int,
              gather: str, reported: float) -> dict:
    """FSDP2 bf16 against FSDP2 with TLq-HS gradients and agoq's `gather` weight all-gather on `gpus` ranks in nodes
    of `node`: the search's FSDP2 + TLq-HS plan (the gather priced on its own path of the network model,
    agoq.search.layouts.gather_path), priced with `gather` and, beside it, with FSDP2's bf16 one."""
    from agoq.search.price import Configuration, price, with_knobs
    from agoq.search.request import SearchRequest, knob_space
    from agoq.search.search import search

    base = plan_row(profile, gpus, node, network, budget, "fsdp", "bf16")
    target, whatif = retarget(profile, gpus, node, network)
    request = SearchRequest(budget, space=knob_space(layout="fsdp", gradients="sdp4bit"), front_budgets=0)
    plan = search(target, request, progress=False, alternatives=False).plan
    config = Configuration.of_plan(plan)
    step = {g: price(target, with_knobs(config, weight_gather=g)).step_seconds for g in (gather, "bf16")}
    q, b = step[gather], base.get("step_seconds")
    return {"paper": paper, "setup": f"{gpus} GPUs ({gpus // node} nodes of {node}), {label}", "gpus": gpus,
            "node_size": node, "network": whatif.network.describe(), "network_stated": stated,
            "reported_speedup": reported, "baseline": "FSDP2 bf16 (ZeRO-3)",
            "variant": f"FSDP2 + TLq-HS gradients + {gather} weight all-gather",
            "baseline_seconds": b, "variant_seconds": q, "agoq_speedup": None if not b else b / q,
            "plan_weight_gather": plan.parallel.weight_gather or "bf16",
            "tlq_hs_only_seconds": step["bf16"],
            "agoq_speedup_tlq_hs_only": None if not b else b / step["bf16"],
            "kind": "step"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(PROFILE))
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    rows = [
        agoq_allreduce(profile, "intra=32@5,inter=3.125@10", "200 Gb/s per node", 3.4,
                       "GPUs, count and 200 Gb/s stated (DESIGN.md); PCIe 4.0 inside a node and one NIC per node "
                       "(3.125 GB/s per GPU) assumed"),
        agoq_allreduce(profile, "intra=32@5,inter=0.15625@30", "10 Gb/s per node", 3.7,
                       "10 Gb/s stated; the rest as above"),
        fsdp_step(profile, "SDP4Bit", 128, 8, "nvlink-h800+ib-ndr400", "NVLink + 400 Gb/s InfiniBand per GPU",
                  "GPU count stated; the network is our assumption (a usual H800 cluster)", 32 * GB, "int4", 4.08),
        fsdp_step(profile, "SDP4Bit", 128, 8, "nvlink-h800+ethernet-25g", "NVLink + 25 GbE per node "
                  "(communication-bound)", "GPU count stated; a slow network assumed to reach the paper's "
                  "communication-bound setting", 32 * GB, "int4", 4.08),
        fsdp_step(profile, "ZeRO++", 384, 16, "intra=150@3,inter=12.5@10", "V100 NVLink + 100 Gb/s per GPU",
                  "GPU count stated; V100 NVLink (300 GB/s both ways) and 100 Gb/s per GPU assumed", 32 * GB, "int8",
                  2.16),
        fsdp_step(profile, "ZeRO++", 384, 16, "intra=150@3,inter=0.39@30", "V100 NVLink + 25 GbE per node (low "
                  "bandwidth)", "GPU count stated; a low-bandwidth network assumed", 32 * GB, "int8", 2.16),
    ]
    print(f"what-if from {args.profile} (compute: the probe's, 953M parameters, 2 x 4096 tokens per rank)")
    print(f"{'paper':8} {'setup':60} {'reported':>9} {'agoq what-if':>13}")
    for r in rows:
        s = r["agoq_speedup"]
        print(f"{r['paper']:8} {r['setup'][:60]:60} {r['reported_speedup']:>8.2f}x "
              f"{('%.2fx' % s) if s else 'no plan':>13}")
    from experiments.record import write_result

    path = write_result("whatif_papers", {"profile": str(Path(args.profile).relative_to(ROOT))
                                          if Path(args.profile).resolve().is_relative_to(ROOT)
                                          else str(args.profile),
                                          "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
