"""The steps `agoq profile` measures for the search to price plans from (agoq.formats.measured_steps): whole
training steps of the profiled model, each run by `agoq train`'s own code (agoq.train.measure.measure_steps, in
this process, on the built-in corpus, writing nothing), at every kind of step a plan may be:

  in each compile mode (eager; compiled with --compile, the default on a GPU), at every micro-batch m dividing the
  profiled one, with one and with two micro-batches per step:
    bf16 (every layer kept), agoq-paper (every layer under LAAQ), checkpoint-all; bf16 gradients, the fused 8-bit
    AdamW over float32 masters (the search's base knobs)
    bf16 with QuanGrad's 8-bit gradients (its accumulation path at two micro-batches)
  at the profiled micro-batch: bf16 with float32 AdamW, and the 8-bit AdamW without masters
  compiled: bf16 under torch.compile's activation_memory_budget 0.5 and 0.1 (compile's own memory saver)
  where the host link was measured (a GPU), in each compile mode at every micro-batch m, with one and with two
    micro-batches per step: agoq-paper with the first K decoder layers' saved tensors offloaded to host memory (K:
    every layer but the last, which backward needs first; one layer of a one-layer model), beside agoq-paper
    without: what offloading a layer costs as the runtime does it (its hooks and copies per tensor, the link and
    the compute it overlaps), which the search prices offload from (agoq.search.costs). Both accumulations, as a
    step of several micro-batches offloads at a cost one micro-batch does not show (the 129 M byte LLaMA at
    micro-batch 1, 10 layers offloaded: +24 % at one micro-batch per step, +72-96 % at four)

Each is `steps` optimizer steps: its step time the median after the first, its peak the largest of any step (the
first, which compiles and allocates, included). With `repeats` R > 1 every eager kind is measured R times (and every
compiled one `compiled_repeats` times, by default R too), each pass in the other order (forward, reversed, ...), and
the row keeps the least of its medians: a GPU step is slowed, never sped up, by what else the process or the
machine does (a stalled host thread, another process), and the search adds and subtracts these rows, so one slowed
kind would misprice every plan priced from it. The medians of all passes are kept in the row
(`repeat_step_seconds`); kinds whose passes differ by more than SPREAD_WARNING are returned as notes. `agoq
profile` on a GPU measures eager kinds twice and compiled kinds once: on one H200 (the probe, 16 kinds x 2 passes,
`experiments/results/profile_steps_cost*.json`) compiled kinds' two passes agreed within 5 % (most within 2 %),
and the search prices a compiled step from its fastest steady step (agoq.search.timing), while eager kinds at
micro-batch 1, whose step the host sets, differed by up to 24 % and are priced from the mean of their passes. The
second pass of the compiled kinds cost about 65 s of a profile (their layers compiled again). A kind that fails (out of memory, a compiler error) is listed in the profile's failures and left out: the
search does not offer plans of that kind.

With a `journal` file, each measured pass of a kind (or its failure) is appended to it as one JSON line, flushed to
disk, the moment it is done, beside the request it was measured for; a later call with the same request reads it back
and measures only what is missing (`agoq profile --resume`), so a profile stopped in its steps (a lost machine, a
time limit) loses at most the kind it was in.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

from agoq.formats.measured_steps import POLICIES

JOURNAL_NAME = "measured_steps.journal.jsonl"  # in the profile folder, while its measured steps are taken
MEMORY_BUDGETS = (0.5, 0.1)
SPREAD_WARNING = 0.10  # passes of one kind whose medians differ by more than this fraction are reported
BASE = {"gradients": "bf16", "optimizer": "adamw8bit", "master": "fp32"}


def step_kinds(micro_batch: int, compile_modes: list[str], memory_budgets=MEMORY_BUDGETS,
               offload_layers: Optional[int] = None) -> list[dict]:
    """The knob combinations of the module docstring, in the order they are measured (`offload_layers` K: the
    offloading kinds, the first K layers offloaded; None: none)."""
    kinds = []
    for compile_mode in compile_modes:
        for m in [d for d in range(micro_batch, 0, -1) if micro_batch % d == 0]:
            for accum in (1, 2):
                for policy in POLICIES:
                    kinds.append({"compile": compile_mode, "policy": policy, "micro_batch": m, "grad_accum": accum,
                                  **BASE})
                kinds.append({"compile": compile_mode, "policy": "bf16", "micro_batch": m, "grad_accum": accum,
                              **BASE, "gradients": "quangrad8"})
        for optimizer, master in (("adamw", "fp32"), ("adamw8bit", "none")):
            kinds.append({"compile": compile_mode, "policy": "bf16", "micro_batch": micro_batch, "grad_accum": 1,
                          **BASE, "optimizer": optimizer, "master": master})
        if compile_mode == "compiled":
            for budget in memory_budgets:
                kinds.append({"compile": compile_mode, "policy": "bf16", "micro_batch": micro_batch, "grad_accum": 1,
                              **BASE, "activation_memory_budget": budget})
        if offload_layers:
            for m in [d for d in range(micro_batch, 0, -1) if micro_batch % d == 0]:
                for accum in (1, 2):
                    kinds.append({"compile": compile_mode, "policy": "agoq-paper", "micro_batch": m,
                                  "grad_accum": accum, **BASE, "offload_layers": int(offload_layers)})
    for kind in kinds:
        kind.setdefault("activation_memory_budget", None)
    return kinds


def train_settings(kind: dict, model: str, seq_len: int, dtype: str, device: str, steps: int, seed: int) -> dict:
    """`agoq train`'s settings (agoq.train.config.TrainConfig keywords) that run one kind of step."""
    return dict(model=model, device=device, dtype=dtype, seq_len=seq_len, micro_batch=kind["micro_batch"],
                grad_accum=kind["grad_accum"], gradients=kind["gradients"], optimizer=kind["optimizer"],
                master=kind["master"], compile=kind["compile"] == "compiled",
                policy="agoq-paper" if kind["policy"] == "agoq-paper" else None,
                checkpoint_all=kind["policy"] == "checkpoint-all",
                activation_memory_budget=kind["activation_memory_budget"], steps=steps, warmup=1, seed=seed,
                checkpoint_every=0, quiet=True,
                offload=f"0-{kind['offload_layers'] - 1}" if kind.get("offload_layers") else None)


def _read_journal(journal: Path, request: dict, kinds: list[dict], repeats: int) -> tuple[dict, dict]:
    """({(pass, kind index): StepFigures}, {kind index: error}) of `journal`'s lines measured for `request`; lines of
    another request, and a last line cut short by a stop, are skipped."""
    from agoq.train.measure import StepFigures

    done, errors = {}, {}
    if not journal.is_file():
        return done, errors
    for line in journal.read_text().splitlines():
        try:
            entry = json.loads(line)
            if entry.get("request") != request or entry.get("kind") not in kinds:
                continue
            i, r = kinds.index(entry["kind"]), int(entry["pass"])
            if "error" in entry:
                errors[i] = str(entry["error"])
            elif 0 <= r < repeats:
                done[(r, i)] = StepFigures.from_dict(entry["figures"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return done, errors


def _append(journal: Path, entry: dict) -> None:
    with open(journal, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def measure_profile_steps(model: str, *, layers: Optional[int], seq_len: int, micro_batch: int, dtype: str,
                          device: str, compile_modes: list[str], steps: int, seed: int = 0, repeats: int = 1,
                          compiled_repeats: Optional[int] = None, progress: bool = True,
                          offload_layers: Optional[int] = None,
                          measure: Optional[Callable] = None,
                          journal: Optional[Path] = None) -> tuple[list[dict], list[dict], list[str]]:
    """Measure every kind of `step_kinds` on `model` (a preset or config.json; with `layers`, that many decoder
    layers) `repeats` times, its compiled kinds `compiled_repeats` times (None: `repeats`) (see the module
    docstring; `offload_layers` K adds the offloading kinds); returns (rows of agoq.formats.measured_steps, failures, notes on kinds whose passes disagree). `measure(TrainConfig) ->
    StepFigures` is agoq.train.measure.measure_steps unless given. With `journal`, what it holds for this request is
    kept and each pass measured now is added to it (module docstring)."""
    from agoq.progress import progress_bar
    from agoq.train import collector
    from agoq.train.config import TrainConfig

    if measure is None:
        from agoq.train.measure import measure_steps as measure
    compiled_repeats = repeats if compiled_repeats is None else compiled_repeats
    if repeats < 1 or compiled_repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats} and {compiled_repeats} (compiled)")
    kinds = step_kinds(micro_batch, compile_modes, offload_layers=offload_layers)
    passes_of = [compiled_repeats if kind["compile"] == "compiled" else repeats for kind in kinds]
    repeats = max(passes_of)
    request = {"model": model, "layers": layers, "seq_len": seq_len, "micro_batch": micro_batch, "dtype": dtype,
               "device": device, "compile_modes": list(compile_modes), "steps": steps, "seed": seed,
               "offload_layers": offload_layers}
    done, errors = _read_journal(journal, request, kinds, repeats) if journal is not None else ({}, {})
    passes: list[list[Optional[object]]] = [[done.get((r, i)) for i in range(len(kinds))] for r in range(repeats)]
    with tempfile.TemporaryDirectory(prefix="agoq-profile-steps-") as tmp:
        spec = model
        if layers is not None:  # the profiled model: a config of that many layers (the same fingerprint)
            from agoq.models import resolve_config

            config = resolve_config(model).to_dict()
            config["num_hidden_layers"] = layers
            spec = str(Path(tmp) / "model.json")
            Path(spec).write_text(json.dumps(config))
        bar = progress_bar(total=sum(passes_of), desc="measured steps", unit="kind", enabled=progress)
        with collector.hold():  # one full collection per kind, not three (agoq.train.collector)
            for r in range(repeats):
                order = range(len(kinds)) if r % 2 == 0 else range(len(kinds) - 1, -1, -1)
                for i in order:
                    if r >= passes_of[i]:  # a kind measured fewer times (compiled_repeats)
                        continue
                    if i in errors or passes[r][i] is not None:  # failed once (not tried again), or in the journal
                        bar.update(1)
                        continue
                    settings = train_settings(kinds[i], spec, seq_len, dtype, device, steps, seed)
                    try:
                        passes[r][i] = measure(TrainConfig(**settings))
                    except Exception as e:  # noqa: BLE001 - one kind failing (out of memory, ...) keeps the rest
                        errors[i] = f"{type(e).__name__}: {e}"[:500]
                    if journal is not None:
                        _append(journal, {"request": request, "kind": kinds[i], "pass": r,
                                          **({"error": errors[i]} if i in errors else {"figures": passes[r][i].to_dict()})})
                    bar.update(1)
        bar.close()
    rows, failures, notes = [], [], []
    for i, kind in enumerate(kinds):
        if i in errors:
            failures.append({"what": f"measured step {_describe(kind)}", "error": errors[i]})
            continue
        measured = [p[i] for p in passes[:passes_of[i]]]
        medians = [f.median_seconds for f in measured]
        best = measured[medians.index(min(medians))]
        peaks = [f.max_peak_bytes for f in measured if f.max_peak_bytes is not None]
        firsts = [f.first_peak_bytes for f in measured if f.first_peak_bytes is not None]
        row = {**kind, "steps": steps, "step_seconds": min(medians), "peak_bytes": max(peaks) if peaks else None,
               "first_step_peak_bytes": max(firsts) if firsts else None, "first_step_seconds": measured[0].seconds[0],
               "seconds_per_step": list(best.seconds), "source": "profile"}
        if kind.get("offload_layers"):
            row["offloaded_bytes"] = int(getattr(best, "offloaded_bytes", None) or 0)
        if passes_of[i] > 1:
            row["repeat_step_seconds"] = medians
            if len(peaks) == len(measured):  # each pass's largest step peak: their spread is the peak's own
                row["repeat_peak_bytes"] = [int(v) for v in peaks]
            if max(medians) > (1 + SPREAD_WARNING) * min(medians):
                notes.append(f"{_describe(kind)}: passes measured "
                             + ", ".join(f"{m * 1e3:.1f}" for m in medians) + " ms; the least is kept")
        rows.append(row)
    return rows, failures, notes


def _describe(kind: dict) -> str:
    budget, offload = kind["activation_memory_budget"], kind.get("offload_layers")
    return (f"{kind['compile']} {kind['policy']}" + (f" activation_memory_budget {budget:g}" if budget else "")
            + (f" with layers 0-{offload - 1} offloaded" if offload else "")
            + f", micro-batch {kind['micro_batch']} x {kind['grad_accum']}, gradients {kind['gradients']}, "
              f"{kind['optimizer']}, masters {kind['master']}")


__all__ = ["step_kinds", "train_settings", "measure_profile_steps", "MEMORY_BUDGETS", "SPREAD_WARNING",
           "JOURNAL_NAME"]
