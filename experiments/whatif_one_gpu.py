"""A cluster planned from one GPU, checked against 2-GPU runs: a profile of the probe on ONE H200, re-targeted to 2
ranks (agoq.search.whatif) over the network each run used, and each FSDP2 layout the runs trained priced by the one
price (agoq.search.price), beside the step the run measured.

Runs (committed results files, `experiments/train_fsdp.py`: probe, micro-batch 2 x 4096 tokens per rank, eager,
AdamW over float32 masters, 30 or 300 steps):

  nvlink   train_fsdp_nvlink_fused_gather.json, train_fsdp_nvlink_int4_gather_300.json; the network: the preset
           nvlink-h100 (the H200's NVLink is the H100 SXM's, 900 GB/s both directions)
  sockets  train_fsdp_sockets_fused_gather.json (NCCL's socket transport on loopback); the network: the link fitted
           to the 2-GPU sockets profile's collectives (experiments/results/profiles/probe-2gpu-sockets), the
           what-if's own fit, with its quantized paths' kernels

The runs' TLq-HS variants ran with --node-size 1 (each rank its own node: TLq's int4 level between them), priced so.

    python experiments/whatif_one_gpu.py --profile experiments/results/profiles/probe-h200-1129 --name NAME

Writes experiments/results/NAME.json (default whatif_one_gpu): rows {name, predicted_step_seconds,
measured_step_seconds, predicted_tokens_per_second, measured_tokens_per_second, relative_error} and the profile's
layout steps it was calibrated on (none: a profile without them). A row the search would not offer (FSDP2's int8
gather with bf16 gradients: quantized gathers come with TLq-HS) says so (`offered_by_search`): the profile measures
no layout step of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agoq.formats.profile import load_profile  # noqa: E402
from agoq.search.knobs import weight_gathers  # noqa: E402
from agoq.search.network_fit import fit_collectives  # noqa: E402
from agoq.search.price import Configuration, price  # noqa: E402
from agoq.search.problem import ProblemSettings  # noqa: E402
from agoq.search.whatif import retarget  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
SOCKETS_PROFILE = RESULTS / "profiles" / "probe-2gpu-sockets"
RUN_FILES = {"nvlink": ["train_fsdp_nvlink_fused_gather", "train_fsdp_nvlink_int4_gather_300"],
             "sockets": ["train_fsdp_sockets_fused_gather"]}
TOKENS_PER_RANK = 2 * 4096


def measured_runs() -> list[dict]:
    """Every FSDP2 run of the results files: transport, its settings and its median step."""
    out = []
    for transport, names in RUN_FILES.items():
        for name in names:
            figures = json.loads((RESULTS / f"{name}.json").read_text())["figures"]
            for key, run in figures["runs"].items():
                s = run["settings"]
                if s["parallel"] != "fsdp":
                    continue
                out.append({"name": f"{name}:{key}", "transport": transport, "gradients": s["gradients"],
                            "weight_gather": s.get("weight_gather") or "bf16", "node_size": s.get("node_size"),
                            "optimizer": s["optimizer"], "master": s["master"],
                            "compile": "compiled" if s.get("compile") else "eager",
                            "measured_step_seconds": run["median_step_seconds"]})
    return out


def link_spec(network) -> str:
    """--network SPEC of a Network's two links (GB/s @ us)."""
    return ",".join(f"{level}={link.bandwidth / 1e9:.6g}@{link.latency * 1e6:.6g}"
                    for level, link in (("intra", network.intra), ("inter", network.inter)))


def searched_plan(profile: str, network: str, budget: str) -> dict:
    """`agoq search` at `budget` for 2 ranks in one node over `network`: the plan's knobs, predicted step and the
    alternative it was compared with."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        subprocess.run([sys.executable, "-m", "agoq.cli", "search", "--profile", profile, "--budget", budget,
                        "--world-size", "2", "--node-size", "2", "--network", network, "--out", str(out), "--quiet"],
                       check=True, capture_output=True, text=True)
        plan = json.loads(out.read_text())
    alt = plan.get("alternative") or {}
    dims = plan["parallel"]
    return {"network": network, "parallel": dims, "gradients": plan["gradients"]["mode"],
            "optimizer": plan["optimizer"], "training": plan["training"], "decision": plan.get("decision"),
            "what": (f"{'fsdp' if dims.get('shard', 1) > 1 else 'ddp'} {plan['training']['compile']}, gradients "
                     f"{plan['gradients']['mode']}, weight gather {dims.get('weight_gather') or 'bf16'}, "
                     f"{plan['optimizer']['name']}"),
            "step_seconds": plan["predicted"]["step_seconds"], "alternative": alt.get("name"),
            "alternative_step_seconds": (alt.get("predicted") or {}).get("step_seconds")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(RESULTS / "profiles" / "probe-h200-1129"))
    ap.add_argument("--name", default="whatif_one_gpu")
    ap.add_argument("--budget", default="20GB", help="the budget per GPU of the plans searched on each network")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    if profile.world_size != 1:
        raise SystemExit(f"{args.profile} was measured on {profile.world_size} ranks: give a one-GPU profile")
    networks = {"nvlink": "nvlink-h100", "sockets": fit_collectives(load_profile(SOCKETS_PROFILE).collectives).network()}
    rows = []
    for run in measured_runs():
        node_size = run["node_size"] or 2
        target, whatif = retarget(profile, 2, node_size, networks[run["transport"]])
        knobs = ProblemSettings(layout="fsdp", gradient_mode=run["gradients"], weight_gather=run["weight_gather"],
                                optimizer=run["optimizer"], master=run["master"], compile_mode=run["compile"],
                                micro_batch=2, grad_accum=1)
        p = price(target, Configuration(knobs))
        measured = run["measured_step_seconds"]
        rows.append({**run, "node_size": node_size, "network": whatif.network.describe(),
                     "offered_by_search": run["weight_gather"] in weight_gathers("fsdp", run["gradients"]),
                     "predicted_step_seconds": p.step_seconds,
                     "predicted_communication_seconds": p.communication_seconds,
                     "predicted_tokens_per_second": 2 * TOKENS_PER_RANK / p.step_seconds,
                     "measured_tokens_per_second": 2 * TOKENS_PER_RANK / measured,
                     "relative_error": measured / p.step_seconds - 1})
    print(f"{'run':72} {'predicted':>10} {'measured':>10} {'tok/s error':>12}")
    for r in rows:
        print(f"{r['name']:72} {r['predicted_step_seconds'] * 1e3:>8.1f}ms {r['measured_step_seconds'] * 1e3:>8.1f}ms "
              f"{r['relative_error']:>+12.1%}" + ("" if r["offered_by_search"] else "  (not a configuration the "
                                                  "search offers: no layout step of it)"))
    plans = {transport: searched_plan(args.profile, network, args.budget) for transport, network in
             (("nvlink", "nvlink-h100"), ("sockets", link_spec(networks["sockets"])))}
    for transport, plan in plans.items():
        print(f"{transport}: the plan at {args.budget}: {plan['what']}, predicted {plan['step_seconds'] * 1e3:.1f} ms; "
              f"its alternative {plan['alternative']} {plan['alternative_step_seconds'] * 1e3:.1f} ms")
    from experiments.record import write_result

    steps = profile.layout_steps() if hasattr(profile, "layout_steps") else []
    path = write_result(args.name, {"profile": str(Path(args.profile).resolve().relative_to(ROOT)),
                                    "profile_layout_steps": steps, "rows": rows, "plans": plans})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
