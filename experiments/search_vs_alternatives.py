"""agoq's default plan against the best alternative that fits the same budget, both measured in one run.

For each model (the probe model, micro-batch 2 x 4096; LLaMA-3-8B shapes with 4 layers, micro-batch 1 x 4096):
  1. profile   `agoq profile` (a subprocess, bits 4 and 8, int), with --compile for --compile-models: the
               compiled steps (agoq.profiler.compiled: bf16, agoq-paper, checkpoint-all, activation_memory_budget
               0.5 / 0.1, smaller micro-batches) in the profile's "compiled" section
  2. budgets   from the alternatives' predicted peaks (agoq.search.alternatives): "bf16 fits" (the least bf16
               peak + 2 %), "only selective checkpointing fits" (halfway between full checkpointing's and bf16's
               peaks), "below compile's smallest peak" (97 % of the least compiled peak, never below the plan's
               smallest feasible budget)
  3. search    the default search (agoq.search.plan_from_profile: most tokens/s within the recipe's error)
  4. measure   the plan and its best alternative, real steps of agoq train on its synthetic corpus
               (agoq.train.measure.measure_plan: the plan's optimizer, gradient storage and compile mode);
               torch.compile's memory-budget alternative by a compiled step (agoq.profiler.compiled)

Checks per budget: measured peak <= budget, predicted step within 5 % of measured, and where the plan quantizes
anything, plan tokens/s >= 1.2 x the alternative's. Also: the 32-layer LLaMA-3-8B peak (vocab 128256, as
experiments/train_8b_memory.py trains it) predicted from the 4-layer profile against the committed 83.9 / 51.8 GB.

GPU (one H200, about 8 minutes):  python experiments/search_vs_alternatives.py
CPU smoke (tiny model, no compile): python experiments/search_vs_alternatives.py --smoke
Writes experiments/results/search_vs_alternatives.json (search_vs_alternatives_smoke.json for --smoke).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.record import write_result  # noqa: E402

MODELS = {  # name -> (spec, layers, micro_batch, seq_len)
    "probe": ("probe", None, 2, 4096),
    "llama-3-8b-4l": ("llama-3-8b", 4, 1, 4096),
}
SMOKE = {"llama-tiny": ("llama-tiny", 2, 2, 32)}
TRAIN_8B = Path(__file__).resolve().parent / "results" / "train_8b_memory.json"


def profile(spec, layers, mb, seq, device, out: Path, smoke: bool, compiled: bool) -> None:
    """`agoq profile` in a subprocess; with `compiled`, its compiled steps too (the profile's "compiled" section)."""
    cmd = [sys.executable, "-m", "agoq.cli", "profile", spec, "--device", device, "--out", str(out),
           "--micro-batch", str(mb), "--seq-len", str(seq), "--bits", "4,8", "--formats", "int", "--batches", "1",
           "--quiet", "--compile" if compiled else "--no-compile"]
    if layers:
        cmd += ["--layers", str(layers)]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def budgets(prof) -> dict:
    """The three budgets of the module docstring, from the alternatives priced at an unbounded budget."""
    import numpy as np

    from agoq.search.alternatives import price_alternatives
    from agoq.search.costs import ProblemSettings, build_problem, checkpointing_only, compile_modes
    from agoq.search.knobs import budget_bounds

    mb = int(prof.settings["micro_batch"])
    alts = price_alternatives(prof, float("inf"), [(mb, 1)], compile_modes(prof))
    bf16 = min(a.peak_bytes for a in alts if a.compile == "eager" and "bf16" in a.name)
    ckpt = checkpointing_only(build_problem(prof, ProblemSettings(optimizer="adamw8bit", master="fp32")))
    full = max(ckpt.evaluate(np.array([], dtype=int), np.ones(ckpt.num_layers, dtype=bool))["peak_bytes_per_stage"])
    compiled = [a.peak_bytes for a in alts if a.compile == "compiled"]
    least = budget_bounds(prof)[0]  # the smallest any knob combination fits (quangrad8 is not always the least)
    low = int(0.97 * min(compiled)) if compiled else int(1.01 * full)
    return {"bf16 fits": int(1.02 * bf16), "only selective checkpointing fits": (full + bf16) // 2,
            "below compile's smallest peak": max(low, int(1.01 * least))}


def measure_alternative(prof, plan, alt, steps: int) -> dict:
    from agoq.train.measure import measure_plan

    config = prof.model_config()
    if alt.activation_memory_budget is not None:
        import torch

        from agoq.models import build
        from agoq.profiler.compiled import compiled_step

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = build(dict(config), dtype=torch.bfloat16, device=device, seed=0)
        ids = torch.randint(0, model.config.vocab_size, (alt.micro_batch, plan.training.seq_len + 1), device=device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        m = compiled_step(model, ids, memory_budget=alt.activation_memory_budget, steps=steps)
        del model
        return {"step_seconds": m["step_seconds"], "peak_bytes": m["peak_bytes"]}
    data = plan.to_dict()
    data.update({"layers": [{"layer": lp.layer, "stage": lp.stage, "checkpoint": lp.layer in alt.checkpoint_layers,
                             "kinds": {}} for lp in plan.layers],
                 "gradients": {**data["gradients"], "mode": "bf16"}, "optimizer": alt.optimizer.model_dump(),
                 "training": {**data["training"], "micro_batch": alt.micro_batch, "grad_accum": alt.grad_accum,
                              "compile": alt.compile},
                 "alternative": None, "alternatives": [], "decision": None})
    r = measure_plan(data, config, micro_batch=alt.micro_batch, seq_len=plan.training.seq_len,
                     grad_accum=alt.grad_accum, steps=steps)
    return {"step_seconds": r["step_seconds"], "peak_bytes": r["peak_bytes"]}


def run_model(name, spec, layers, mb, seq, device, work: Path, steps: int, compile_: bool, smoke: bool) -> dict:
    from agoq.formats.profile import load_profile
    from agoq.search.search import plan_from_profile
    from agoq.train.measure import measure_plan

    folder = work / name
    t = time.perf_counter()
    profile(spec, layers, mb, seq, device, folder, smoke, compile_)
    out = {"profile_seconds": time.perf_counter() - t}
    prof = load_profile(folder)
    if compile_:
        out["compiled_profile_seconds"] = prof.header.get("seconds", {}).get("compiled")
        out["compiled_section"] = prof.header.get("compiled")
    out["profile_memory_steps"] = prof.memory.get("steps")
    out["budgets"] = {}
    for label, budget in budgets(prof).items():
        t = time.perf_counter()
        plan = plan_from_profile(prof, budget)
        search_s = time.perf_counter() - t
        r = measure_plan(plan.to_dict(), prof.model_config(), micro_batch=plan.training.micro_batch,
                         seq_len=plan.training.seq_len, grad_accum=plan.training.grad_accum, steps=steps)
        tokens = plan.training.micro_batch * plan.training.grad_accum * plan.training.seq_len
        quantized = any(s not in (16, "16") for lp in plan.layers for s in lp.kinds.values())
        row = {"budget_bytes": budget, "search_seconds": search_s, "decision": plan.decision.model_dump(mode="json"),
               "layers": [lp.model_dump(mode="json") for lp in plan.layers], "quantizes": quantized,
               "plan": {"predicted_step_seconds": plan.predicted.step_seconds,
                        "predicted_peak_bytes": max(plan.predicted.peak_bytes_per_stage),
                        "measured_step_seconds": r["step_seconds"], "measured_peak_bytes": r["peak_bytes"],
                        "measured_tokens_per_second": tokens / r["step_seconds"]}}
        alt = plan.alternative
        if alt is not None:
            m = measure_alternative(prof, plan, alt, steps)
            atok = alt.micro_batch * alt.grad_accum * plan.training.seq_len
            row["alternative"] = {"name": alt.name, "predicted_step_seconds": alt.predicted.step_seconds,
                                  "predicted_peak_bytes": alt.predicted.peak_bytes,
                                  "measured_step_seconds": m["step_seconds"], "measured_peak_bytes": m["peak_bytes"],
                                  "measured_tokens_per_second": atok / m["step_seconds"]}
            row["speedup_measured"] = row["plan"]["measured_tokens_per_second"] / (atok / m["step_seconds"])
            row["speedup_predicted"] = alt.speedup_predicted
        p = row["plan"]
        row["checks"] = {
            "peak_within_budget": None if p["measured_peak_bytes"] is None else p["measured_peak_bytes"] <= budget,
            "predicted_step_error": p["predicted_step_seconds"] / p["measured_step_seconds"] - 1,
            "predicted_step_within_5_percent": abs(p["predicted_step_seconds"] / p["measured_step_seconds"] - 1) <= 0.05,
            "speedup_at_least_1_2": None if not quantized or alt is None else row["speedup_measured"] >= 1.2}
        print(f"{name} {label}: budget {budget / 2**30:.2f} GiB, plan {p['measured_step_seconds'] * 1e3:.1f} ms "
              f"(predicted {p['predicted_step_seconds'] * 1e3:.1f}), alternative "
              f"{alt.name if alt else 'none'}: {row.get('alternative', {}).get('measured_step_seconds', 0) * 1e3:.1f} "
              f"ms, speed-up {row.get('speedup_measured', float('nan')):.2f}x", flush=True)
        out["budgets"][label] = row
    if spec == "llama-3-8b":
        out["full_8b_peak_check"] = full_8b_check(prof)
    return out


def full_8b_check(prof) -> dict:
    """The 32-layer LLaMA-3-8B peak (vocab 128256, micro-batch 1 x 4096, agoq-paper, QuanGrad, fused 8-bit AdamW)
    predicted from this 4-layer profile and agoq.optim.state_bytes, against experiments/results/train_8b_memory.json:
    static + the 32 layers' activations + the eager memory model's rest (agoq.models.step_peak.extra_bytes: the
    chunked loss's forward peak, the calibrated workspace, and QuanGrad's buffer where the calibration step had
    no bf16 gradient yet) + the profile's LAAQ transient."""
    import torch

    from agoq.activations.activation_bytes import LayerShape, predict_layer_bytes
    from agoq.activations.policy import as_policy
    from agoq.models import build
    from agoq.models.llama import PRESETS
    from agoq.optim.state_bytes import state_bytes
    from agoq.models.step_peak import extra_bytes, head_peak_bytes, head_peak_parts, head_shape_of

    cfg = PRESETS["llama-3-8b"]  # agoq train keeps the model's vocabulary (128256) on byte data
    numels = [p.numel() for p in build(cfg, device="meta", dtype=torch.bfloat16).parameters()]
    mb, seq = int(prof.settings["micro_batch"]), int(prof.settings["seq_len"])
    shape = LayerShape.from_config(cfg, mb, seq, 2)
    policy = as_policy("agoq-paper")
    activations = sum(sum(predict_layer_bytes(shape, policy.settings(i), policy.block).values()) for i in range(32))
    mem = prof.memory
    paper = next((s for s in mem.get("steps", []) if s.get("policy") == "agoq-paper"), {})
    transient = max(0, (paper.get("measured_peak_bytes_forward_backward") or 0)
                    - (paper.get("predicted_peak_bytes_forward_backward") or 0))
    head = head_shape_of(mem, prof.model_config(), mb, seq, 2)  # the same head at 4 and 32 layers
    measured = json.loads(TRAIN_8B.read_text())["figures"]["variants"] if TRAIN_8B.exists() else {}
    out = {"activation_bytes": activations, "fixed_bytes_4_layer_profile": mem.get("fixed_bytes"),
           "outside_activation_bytes": mem.get("outside_activation_bytes"),
           "gradients_bytes_bf16_4_layer_profile": mem.get("gradients_bytes_bf16"), "laaq_transient_bytes": transient,
           "head_peak_parts": head_peak_parts(head) if head else None,
           "head_peak_bytes": head_peak_bytes(head) if head else None}
    for variant, master in (("agoq", "fp32"), ("agoq-nomaster", "none")):
        static = state_bytes(numels, optimizer="adamw8bit", master=master, gradients="quangrad8")
        extra = extra_bytes(mem, head, "quangrad8", mb, mb)
        predicted = static["total"] + activations + extra + transient
        got = measured.get(variant, {}).get("peak_bytes")
        out[variant] = {"static": static, "extra_bytes": extra, "predicted_peak_bytes": predicted,
                        "measured_peak_bytes": got, "relative_error": None if not got else predicted / got - 1}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, no compile: checks the script")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per plan (the first not timed)")
    ap.add_argument("--compile-models", default="probe",
                    help="models whose compiled steps are measured (compiled plans and alternatives; each costs about "
                         "a minute of compiling): comma-separated, or 'none' (default probe)")
    ap.add_argument("--work", default=None, help="folder for the profiles (default: a temporary one)")
    args = ap.parse_args()
    import torch

    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU: run with --smoke on the CPU")
    table = SMOKE if args.smoke else MODELS
    names = args.models.split(",") if args.models else list(table)
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        for name in names:
            spec, layers, mb, seq = table[name]
            compiled = not args.smoke and name in args.compile_models.split(",")
            results[name] = run_model(name, spec, layers, mb, seq, device, work, args.steps, compiled, args.smoke)
            figures = {"models": results, "wall_seconds": time.perf_counter() - started, "smoke": args.smoke,
                       "complete": name == names[-1]}  # written after every model: a cut-off run keeps its models
            path = write_result("search_vs_alternatives" + ("_smoke" if args.smoke else ""), figures)
    print("wrote", path)


if __name__ == "__main__":
    main()
