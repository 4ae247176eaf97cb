"""How long `agoq profile` takes for a whole model, and what it finds: run counts, a prediction made
from timed unit costs before starting, the seconds of each phase, and the memory model against the
measured peaks.

    python experiments/profile_speed.py --model probe                       # one H200: target <= 180 s
    python experiments/profile_speed.py --model llama-3-8b --layers 4 --seq-len 4096
                                                                            # one H200: target <= 300 s
    python experiments/profile_speed.py --model llama-tiny                  # CPU check, seconds

Writes experiments/results/profile_speed_<model>.json (and the profile folder under /tmp).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agoq.runtime.activations.laaq import apply_activation_policy, remove_activation_policy  # noqa: E402
from agoq.runtime.activations.policy import KINDS  # noqa: E402
from agoq.runtime.activations.saved_bytes import find_decoder_layers  # noqa: E402
from agoq.formats.profile import load_profile  # noqa: E402
from agoq.profiler.model_source import (  # noqa: E402
    load_model,
    next_token_loss,
    token_batches,
    vocab_size,
)
from agoq.profiler.options import kind_options  # noqa: E402
from agoq.profiler.profile import ProfileSettings, make_profile  # noqa: E402
from agoq.profiler.replay import REPLAYABLE, ReplaySession  # noqa: E402
from agoq.profiler.sensitivity import measurement_policy  # noqa: E402
from experiments.record import write_result  # noqa: E402

TARGETS = {"probe": 180.0, "llama-3-8b": 300.0}


def _timed(fn, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def unit_costs(settings: ProfileSettings) -> dict:
    """Seconds of the kinds of work a profile repeats: a full fwd+bwd under a policy (options replay cannot
    run), a kept reference forward + backward (one per batch and reference), one replayed partial backward
    from the middle layer (every other option), and the last two for attention, whose session reruns
    attention in backward (laaq.rerun_kept_attention)."""
    cuda = settings.device == "cuda"
    model = load_model(settings.spec, dtype=settings.dtype, device=settings.device, num_layers=settings.layers)
    ids = token_batches(vocab_size(model), 1, settings.micro_batch, settings.seq_len, 0, settings.device)[0]
    policy = measurement_policy(None, "qkv_input", settings.block)

    def full_step():
        model.zero_grad(set_to_none=True)
        next_token_loss(model, ids).backward()

    apply_activation_policy(model, policy)
    steps = [_timed(full_step, cuda) for _ in range(4)]
    remove_activation_policy(model)
    model.zero_grad(set_to_none=True)
    sessions, replays = [], []
    middle = len(find_decoder_layers(model)) // 2
    for _ in range(3):
        box = {}
        sessions.append(_timed(lambda: box.update(s=ReplaySession(model, ids, policy)), cuda))
        replays.append(_timed(lambda: box["s"].error(middle, "silu_input", 4, "int"), cuda))
        replays.append(_timed(lambda: box["s"].error(middle, "norm_input", 3, "int"), cuda))
        box["s"].close()
    attention_sessions, attention_replays = [], []
    for _ in range(3):
        box = {}
        attention_sessions.append(_timed(lambda box=box: box.update(s=ReplaySession(model, ids, policy,
                                                                                      attention=True)), cuda))
        attention_replays.append(_timed(lambda box=box: box["s"].error(middle, "attention", 4, "int"), cuda))
        box["s"].close()
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"policy_step": statistics.median(steps[1:]), "reference": statistics.median(sessions[1:]),
            "replay": statistics.median(replays[2:]), "attention_reference": statistics.median(attention_sessions[1:]),
            "attention_replay": statistics.median(attention_replays[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="probe")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 on CUDA, 64 on the CPU")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--bits", default="2,3,4,5,6,8")
    p.add_argument("--formats", default="int,nf4")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    settings = ProfileSettings(spec=args.model, seq_len=args.seq_len or (4096 if cuda else 64),
                               micro_batch=args.micro_batch, dtype="bf16" if cuda else "fp32",
                               device="cuda" if cuda else "cpu", bits=[int(b) for b in args.bits.split(",")],
                               formats=args.formats.split(","), batches=args.batches, layers=args.layers)
    model = load_model(settings.spec, device="meta", num_layers=settings.layers)
    num_layers = len(find_decoder_layers(model))
    per_kind = {k: [o for o in kind_options(k, settings.bits, settings.formats) if o.option != "16"] for k in KINDS}
    replay_runs = num_layers * sum(len([o for o in opts if o.quantized]) for k, opts in per_kind.items()
                                   if k in REPLAYABLE)
    attention_runs = num_layers * len([o for o in per_kind["attention"] if o.quantized])
    policy_runs = num_layers * sum(len(opts) for opts in per_kind.values()) - replay_runs
    runs = replay_runs + policy_runs
    costs = unit_costs(settings)
    b = settings.batches
    predicted = b * (policy_runs * costs["policy_step"] + 2 * costs["policy_step"]  # policy runs + their reference
                     + 2 * costs["reference"] + (replay_runs - attention_runs) * costs["replay"] * (1 + 1 / 6)
                     + costs["attention_reference"] + attention_runs * costs["attention_replay"] * (1 + 1 / 6))
    fwd_bwd = (policy_runs + 2) * b
    print(f"{args.model}: {num_layers} layers, {runs} sensitivity measurements x {b} batch(es): {policy_runs} by "
          f"policy (fwd+bwd {costs['policy_step'] * 1e3:.1f} ms), {replay_runs} replayed (partial bwd "
          f"{costs['replay'] * 1e3:.1f} ms; reference {costs['reference'] * 1e3:.1f} ms) -> predicted "
          f"{predicted:.0f} s for sensitivities")
    out = Path(tempfile.mkdtemp(prefix=f"profile-{args.model}-"))
    start = time.perf_counter()
    header = make_profile(settings, out, progress=True, say=lambda text: print(text, file=sys.stderr))
    wall = time.perf_counter() - start
    target = TARGETS.get(args.model)
    figures = {
        "model": args.model, "layers": num_layers, "seq_len": settings.seq_len, "micro_batch": settings.micro_batch,
        "batches": settings.batches, "bits": settings.bits, "formats": settings.formats,
        "sensitivity_runs": runs, "policy_runs": policy_runs, "replayed_runs": replay_runs,
        "policy_forward_backward": fwd_bwd, "unit_seconds": costs, "predicted_sensitivity_seconds": predicted, "wall_seconds": wall, "phase_seconds": header["seconds"],
        "target_seconds": target, "met": None if target is None else wall <= target,
        "memory": header["memory"], "failures": header["failures"], "profile_dir": str(out),
        "replay_noise_floor": header.get("sensitivity", {}).get("replay_noise_floor"),
    }
    try:
        table = load_profile(out).table
        quant = table[table.format.isin(["int", "nf4"])]
        figures["mean_sensitivity_by_kind_option"] = {
            f"{k}/{o}{'-nf4' if f == 'nf4' else ''}": float(v)
            for (k, o, f), v in quant.groupby(["kind", "option", "format"]).sensitivity.mean().items()}
    except ImportError:
        figures["mean_sensitivity_by_kind_option"] = "pandas not installed: see the profile's CSV"
    print(f"profile of {args.model}: {wall:.1f} s wall"
          + (f" (target {target:.0f} s: {'met' if wall <= target else 'NOT met'})" if target else ""))
    print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in header["seconds"].items()))
    for s in header["memory"]["steps"]:
        print(f"  {s['policy']}: predicted peak {s['predicted_peak_bytes']}, measured {s['measured_peak_bytes']}"
              + (f" ({s['relative_error']:+.2%})" if s.get("relative_error") is not None else ""))
    name = f"profile_speed_{args.model}" + (f"_{args.layers}l" if args.layers else "")
    print(f"wrote {write_result(name, figures)}")


if __name__ == "__main__":
    main()
