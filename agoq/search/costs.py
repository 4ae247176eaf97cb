"""Cost models: memory (bytes), step time (seconds) and gradient error of a per-layer choice, from a Profile.

A `ChoiceProblem` lists, for every (layer, kind), its options with their memory, time and error, plus a
whole-layer `checkpoint` option per layer. Exactly one option is picked per (layer, kind), unless the
layer is checkpointed, in which case none is (the layer then keeps only its input).

  memory of stage s = in_flight[s] x (bytes the stage's layers keep per micro-batch)
                      + the stage's share of weights, gradients (by gradient mode), masters and moments (by
                        optimizer and masters: agoq.optim.state_bytes, as the profile records them)
                      + the rest of the eager step's peak (agoq.models.step_peak.head_and_workspace_bytes: the
                        chunked LM head's tensors at this micro-batch and the calibrated workspace), and for QuanGrad
                        the bf16 gradients the calibration step had not made yet at its peak
  step time, eager  = grad_accum x fb(micro_batch) + E x (extra seconds of the chosen options
                           + laaq_layer_seconds per layer that runs LAAQ's functions + forward of checkpointed layers)
                      + the optimizer step + communication
                      (fb(m): seconds of one bf16 fwd + bwd of m sequences, measured at the profiled micro-batch m0
                      and wherever the profile measured more, a line a + b x m between
                      (agoq.search.compiled_costs.forward_backward_seconds; through the origin with m0 alone);
                      E = grad_accum x fb(micro_batch) / fb(m0): the tokens of the step against the profiled
                      one's, times how much slower each token runs at this micro-batch)
  step time, compiled = grad_accum x fb(micro_batch) + grad_accum x delta per layer that runs LAAQ's functions
                      + E x forward of checkpointed layers + the optimizer step + communication, from the
                      profile's `compiled` section, the options adding no seconds of their own
                      (delta = (compiled agoq-paper step - compiled bf16 step) / layers: agoq.search.compiled_costs
                      says why the eager kernel times do not carry over)
  error             = sum of the chosen options' measured sensitivities (0 for 16, recompute, checkpoint)

Eager, a layer under LAAQ's functions does not run the plain layer's code: its norms and SwiGLU are agoq's fused
kernels, so its own time differs from the unmodified layer's by a constant that the options' extra seconds do
not hold. `laaq_layer_seconds` is that constant, from the profile's measured agoq-paper and bf16 steps:
(paper step - bf16 step - the recipe's extra seconds) / layers. Without it the model over-predicted every
quantized plan on the probe model by ~25 ms (1.7-1.9 ms per layer; experiments/results/search_probe_budgets_*).
Compiled, `laaq_layer_seconds` is grad_accum x delta and the options' seconds are 0.

A stage's peak is the largest of the end of forward (above), the backward of each checkpointed layer and the
optimizer step (the state and its workspace); `ChoiceProblem.memory_parts` gives the phase that sets it and the
peak's parts then (agoq.search.memory_parts; the model state per rank is agoq.search.state's), which a plan
records and the dashboard draws.

Layouts over several ranks (agoq.search.layouts): replicated (DDP) keeps the whole state per rank and pays one
gradient all-reduce per step; agoq's sharded SDP4Bit keeps 1/N of gradients, masters and moments; fsdp (FSDP2)
keeps 1/N of everything plus the unsharded units in flight, its communication priced per micro-batch with the
overlap that module states, and its optimizer step over 1/N of the state.

QuanGrad's gradients: fixed bytes are calibrated on a bf16-gradient step, at whose fwd + bwd peak most gradients
did not exist yet; QuanGrad's buffer is allocated before the step, so a quangrad8 plan's fwd + bwd peak counts
the buffer on top of the calibrated step's gradients. Compiled plans add the compiled peak margin
(agoq.search.compiled_costs).

Two per-layer corrections keep the memory model exact for agoq's runtime: a layer whose kinds are all 16
runs unmodified and keeps what the plain model keeps (float32 norm statistics and all: `unmodified_extra`),
and with attention and o_proj_input both at 16 the o_proj input is a view of attention's output, so it
costs nothing (`shared_credit`). Both are computed with the runtime's byte predictor from the profile's
model config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import pandas as pd

from agoq.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.activations.policy import KEEP, KINDS, RECOMPUTE, stage_aware_policy
from agoq.formats.profile import ProfileData
from agoq.optim.state_bytes import step_bytes_moved
from agoq.models.step_peak import head_and_workspace_bytes, head_shape_of
from agoq.search.collective_times import collective_seconds, has_collective
from agoq.search.compiled_costs import compiled_layer_seconds, compiled_peak_margin, forward_backward_seconds
from agoq.search.layouts import fsdp_exposed_seconds, fsdp_in_flight_bytes, resolve_layout, unit_sizes
from agoq.search.memory_parts import stage_entry
from agoq.search.state import (
    measured_with,
    optimizer_choices,
    resolve_optimizer,
    state_parts,
    state_per_rank,
    static_bytes_total,
)

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
COMM_PATHS = {"bf16": "nccl-bf16", "quangrad8": "quangrad8", "sdp4bit": "sdp4bit"}


@dataclass(frozen=True)
class ProblemSettings:
    """Settings outside the per-layer choice: what the Optuna study varies (defaults: the profile's)."""

    block: Optional[int] = None           # values per quantization scale (None: the profile's block)
    format: str = "int"                   # "int" or "nf4" (4-bit options use the codebook)
    floor_bits: tuple = ()                # ((kind, bits), ...): no quantized option below these bits
    micro_batch: Optional[int] = None     # sequences per micro-batch (None: the profile's)
    grad_accum: int = 1                   # micro-batches per optimizer step
    gradient_mode: str = "bf16"           # bf16, quangrad8 or sdp4bit
    schedule: str = "1f1b"                # pipeline schedule whose in-flight counts apply
    layer_stage: Optional[tuple] = None   # pipeline stage per layer (None: the profile's split)
    allow_checkpoint: bool = True         # offer whole-layer checkpointing
    optimizer: Optional[str] = None       # adamw (float32 moments) or adamw8bit (fused; None: the profile's step's)
    master: Optional[str] = None          # fp32 or none (float32 masters; None: the profile's step's)
    compile_mode: Optional[str] = None    # "eager" or "compiled" (None: the profile's own mode)
    layout: Optional[str] = None          # replicated, sharded or fsdp (agoq.search.layouts; None: the gradient
                                          # mode's own, sharded for sdp4bit, else replicated)

    def floors(self) -> dict[str, int]:
        return dict(self.floor_bits)


@dataclass
class ChoiceProblem:
    """Arrays describing every option (index i) and layer (index l); sizes in bytes, times in seconds."""

    layer: np.ndarray          # [n] layer of option i
    kind: np.ndarray           # [n] kind index (into KINDS) of option i
    option: list               # [n] "16", "8", ..., "recompute"
    memory: np.ndarray         # [n] bytes option i adds to its stage's peak (already x in-flight)
    seconds: np.ndarray        # [n] seconds option i adds per step
    error: np.ndarray          # [n] gradient error option i adds
    layer_stage: np.ndarray    # [L] stage of each layer
    checkpoint_memory: np.ndarray   # [L] bytes a checkpointed layer adds (its input x in-flight)
    checkpoint_seconds: np.ndarray  # [L] seconds a checkpointed layer adds (its forward, again)
    allow_checkpoint: bool
    unmodified_extra: np.ndarray    # [L] bytes added when every kind of the layer is 16
    shared_credit: np.ndarray       # [L] bytes saved when attention and o_proj_input are both 16
    static_bytes: np.ndarray        # [S] weights + gradients + optimizer + fixed, per stage
    base_seconds: float             # step time before the options' extras (bf16 step x accum + comm)
    seconds_scale: float = 1.0      # each option's seconds are already multiplied by grad_accum
    notes: list = field(default_factory=list)
    floor_bytes: Optional[np.ndarray] = None  # [S] the optimizer step's peak, whatever the activations
    in_flight: Optional[np.ndarray] = None    # [S] micro-batches each stage holds (memory is already x this)
    recompute_bytes: Optional[np.ndarray] = None  # [L] what a checkpointed layer's forward keeps when rerun
                                                  # in backward (the unmodified layer's bytes, per micro-batch)

    laaq_transient_bytes: Optional[np.ndarray] = None  # [S] extra peak while a LAAQ layer runs backward
    laaq_layer_seconds: float = 0.0   # seconds per step each layer running LAAQ's functions adds (x accum), < 0
                                      # when agoq's fused layer is faster than the plain one
    static_parts: Optional[dict] = None  # {part: [S] bytes} adding up to static_bytes (agoq.search.memory_parts)
    floor_parts: Optional[dict] = None   # {part: [S] bytes} adding up to floor_bytes

    def laaq_transient(self) -> np.ndarray:
        """Per stage, what the backward of a layer under LAAQ's functions holds beyond the memory model
        (dequantized copies), added when any layer of the stage is neither all-16 nor checkpointed."""
        if self.laaq_transient_bytes is None:
            return np.zeros(self.num_stages)
        return np.asarray(self.laaq_transient_bytes, float)

    def in_flight_counts(self) -> np.ndarray:
        return np.ones(self.num_stages) if self.in_flight is None else np.asarray(self.in_flight, float)

    def recomputed(self) -> np.ndarray:
        return np.zeros(self.num_layers) if self.recompute_bytes is None else np.asarray(self.recompute_bytes, float)

    def peak_floor(self) -> np.ndarray:
        """Per stage, the least peak whatever is chosen (the optimizer step's), bytes."""
        return np.zeros(self.num_stages) if self.floor_bytes is None else np.asarray(self.floor_bytes, float)

    @property
    def num_layers(self) -> int:
        return len(self.layer_stage)

    @property
    def num_stages(self) -> int:
        return len(self.static_bytes)

    def groups(self) -> dict[tuple[int, int], np.ndarray]:
        """(layer, kind index) -> indices of its options."""
        out: dict[tuple[int, int], list[int]] = {}
        for i, (l, k) in enumerate(zip(self.layer, self.kind)):
            out.setdefault((int(l), int(k)), []).append(i)
        return {g: np.array(v) for g, v in out.items()}

    def keeps_16bit(self) -> np.ndarray:
        """Boolean mask of the '16' options."""
        return np.array([o == "16" for o in self.option])

    def _memory(self, chosen: np.ndarray, ckpt: np.ndarray) -> dict:
        """Per stage: the peak (bytes), the phase that sets it (agoq.search.memory_parts) with its checkpointed
        layer, and what the decoder layers hold then ("held") and its rerun layer's bytes ("rerun"); also the
        activations at the end of forward, the LAAQ transient and the number of layers running LAAQ."""
        per_layer = np.zeros(self.num_layers)  # bytes each layer adds to its stage (x in-flight)
        np.add.at(per_layer, self.layer[chosen], self.memory[chosen])
        per_layer[ckpt] += self.checkpoint_memory[ckpt]
        is16 = self.keeps_16bit()
        laaq = np.zeros(self.num_layers, dtype=bool)  # layers running LAAQ's functions
        for l in range(self.num_layers):
            if ckpt[l]:
                continue
            mine = chosen[self.layer[chosen] == l]
            kinds16 = {int(self.kind[i]) for i in mine if is16[i]}
            if len(kinds16) == len({int(self.kind[i]) for i in mine}):
                per_layer[l] += self.unmodified_extra[l]
            if {KINDS.index("attention"), KINDS.index("o_proj_input")} <= kinds16:
                per_layer[l] -= self.shared_credit[l]
            laaq[l] = not all(self.option[i] == "16" for i in mine)
        activations = np.zeros(self.num_stages)
        np.add.at(activations, self.layer_stage, per_layer)
        laaq_stage = np.zeros(self.num_stages, dtype=bool)
        laaq_stage[self.layer_stage[laaq]] = True
        transient = np.where(laaq_stage, self.laaq_transient(), 0.0)
        mem = self.static_bytes + activations + transient
        phase, at_layer = ["forward_backward"] * self.num_stages, [None] * self.num_stages
        held, rerun = activations.copy(), np.zeros(self.num_stages)
        # backward of a checkpointed layer l: the other in-flight micro-batches, this one's layers before l,
        # and l's input plus everything its rerun forward keeps
        flight, extra = self.in_flight_counts(), self.recomputed()
        for l in np.nonzero(ckpt)[0]:
            s = self.layer_stage[l]
            before = per_layer[(self.layer_stage == s) & (np.arange(self.num_layers) < l)].sum()
            kept = (flight[s] - 1) / flight[s] * activations[s] + before / flight[s] \
                + self.checkpoint_memory[l] / flight[s]
            during = self.static_bytes[s] + kept + extra[l] + transient[s]
            if during > mem[s]:
                mem[s], phase[s], at_layer[s], held[s], rerun[s] = during, "checkpoint_backward", int(l), kept, extra[l]
        floor = self.peak_floor()
        for s in np.nonzero(floor > mem)[0]:
            mem[s], phase[s], at_layer[s] = floor[s], "optimizer_step", None
        # whole bytes, rounded up (a fraction of a byte over a budget is over it; 1e-6 absorbs float noise)
        return {"peak": [int(np.ceil(m - 1e-6)) for m in mem], "phase": phase, "layer": at_layer, "held": held,
                "rerun": rerun, "activations": activations, "transient": transient, "laaq_layers": int(laaq.sum())}

    def evaluate(self, chosen: np.ndarray, checkpoint: np.ndarray) -> dict:
        """Memory per stage, step seconds and error of a choice.

        `chosen`: option indices (one per (layer, kind) of non-checkpointed layers); `checkpoint`: bool [L].
        """
        chosen = np.asarray(chosen, dtype=int)
        ckpt = np.asarray(checkpoint, dtype=bool)
        m = self._memory(chosen, ckpt)
        seconds = self.base_seconds + float(self.seconds[chosen].sum()) + float(self.checkpoint_seconds[ckpt].sum()) \
            + self.laaq_layer_seconds * m["laaq_layers"]
        return {"peak_bytes_per_stage": m["peak"], "step_seconds": seconds,
                "grad_error": float(self.error[chosen].sum()),
                "activation_bytes_per_stage": [int(round(a)) for a in m["activations"]],
                "peak_phase_per_stage": m["phase"]}

    def memory_parts(self, chosen: np.ndarray, checkpoint: np.ndarray) -> list[dict]:
        """Per stage, the phase that sets its peak and the parts of the peak then, in whole bytes adding up to the
        stage's `evaluate` peak (agoq.search.memory_parts; a plan's `predicted.memory_per_stage`)."""
        if self.static_parts is None or (self.floor_bytes is not None and self.floor_parts is None):
            raise ValueError("this problem does not list the parts of its static bytes (build_problem's do)")
        m = self._memory(np.asarray(chosen, dtype=int), np.asarray(checkpoint, dtype=bool))
        out = []
        for s in range(self.num_stages):
            if m["phase"][s] == "optimizer_step":
                parts = {name: float(v[s]) for name, v in self.floor_parts.items()}
            else:
                parts = {name: float(v[s]) for name, v in self.static_parts.items()}
                parts["activations"] = float(m["held"][s])
                if m["phase"][s] == "checkpoint_backward":
                    parts["recomputed_layer"] = float(m["rerun"][s])
                parts["laaq_transient"] = float(m["transient"][s])
            out.append(stage_entry(s, m["phase"][s], m["layer"][s], parts, m["peak"][s]))
        return out


# ------------------------------------------------------------------------------------------------


def _layer_shape(profile: ProfileData, micro_batch: int) -> Optional[LayerShape]:
    config = profile.model_config()
    if not config:
        return None
    from agoq.models import resolve_config

    try:
        cfg = resolve_config(dict(config))
    except (ValueError, TypeError, NotImplementedError):  # e.g. a Mistral window the reference model lacks
        return None
    elem = ELEM_BYTES.get(str(profile.settings.get("dtype", "bf16")), 2)
    return LayerShape.from_config(cfg, micro_batch, int(profile.settings.get("seq_len", 1)), elem)


def _kind_bytes(shape: LayerShape, kind: str, setting, block: int) -> int:
    """Bytes of one kind under one setting inside a LAAQ layer (the others quantized, so nothing shares)."""
    settings = {k: 8 for k in KINDS}
    settings[kind] = setting
    return predict_layer_bytes(shape, settings, block)[kind]


def _collective_seconds(profile: ProfileData, mode: str, message_bytes: float) -> float:
    """Seconds the gradient collective of `mode` takes for `message_bytes` fp32 bytes under a replicated or agoq's
    sharded layout (agoq.search.collective_times): bf16 and quangrad8 all-reduce (where the table has the
    all-reduce of the path; else whatever it measured on it), sdp4bit its every op (TLq-HS reduce-scatter + qWD
    all-gather). 0 without a table, NaN without rows for the path."""
    table = profile.collectives
    if table is None or not len(table):
        return 0.0
    path = COMM_PATHS[mode]
    ops = ("all_reduce",) if mode != "sdp4bit" and has_collective(table, "all_reduce", path) else None
    return collective_seconds(table, path, message_bytes, ops)


def gradient_modes(profile: ProfileData) -> list[str]:
    """Gradient modes the profile has the figures for (bf16 always; sdp4bit needs several ranks)."""
    mem = profile.memory
    modes = ["bf16"]
    if mem.get("gradients_bytes_quangrad8") is not None:
        modes.append("quangrad8")
    if int(profile.settings.get("world_size", 1) or 1) > 1:
        modes.append("sdp4bit")
    return modes


COMPILE_MODES = ("eager", "compiled")


def profile_compile_mode(profile: ProfileData) -> str:
    """The compile mode the profile's memory steps and layer times were measured in (eager unless it says)."""
    return str(profile.settings.get("compile_mode") or "eager")


def _steps_of(steps) -> dict:
    return {str(st.get("policy")): st for st in (steps or []) if st.get("step_seconds") is not None}


def mode_timing(profile: ProfileData, compile_mode: Optional[str] = None) -> dict:
    """The step times of one compile mode, seconds at the profiled micro-batch: "bf16" (whole step), "optimizer"
    (its optimizer step, 0 when not measured apart), "paper" (the agoq-paper step, or None), "layer_forward"
    (per layer, or None), "checkpoint_all" (or None), and "forward_backward": {micro_batch: seconds of one bf16
    fwd + bwd} at the profiled micro-batch and, compiled, at the section's `micro_batch_steps`. The profile's own
    mode reads its memory steps; "compiled" reads the profile's optional `compiled` section (docs/formats.md)."""
    own = profile_compile_mode(profile)
    mode = compile_mode or own
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode == own:
        steps = _steps_of(profile.memory.get("steps"))
        forward = (profile.header.get("timing") or {}).get("layer_forward_seconds")
    else:
        section = profile.header.get("compiled") or {}
        steps = _steps_of(section.get("steps"))
        if "bf16" not in steps:
            raise ValueError(f"the profile has no {mode} step times (it was measured {own}; profile with "
                             "--compile to add them)")
        forward = section.get("layer_forward_seconds")
    bf16 = steps.get("bf16")
    profiled = int(profile.settings.get("micro_batch", 1) or 1)
    fb: dict = {}
    if bf16 is not None:
        fb[profiled] = float(bf16["step_seconds"]) - float(bf16.get("optimizer_step_seconds") or 0.0)
    if mode != own:
        for st in section.get("micro_batch_steps") or []:
            if st.get("step_seconds") is not None and int(st["micro_batch"]) != profiled:
                fb[int(st["micro_batch"])] = float(st["step_seconds"]) - float(st.get("optimizer_step_seconds") or 0.0)
    out = {"mode": mode, "bf16": None if bf16 is None else float(bf16["step_seconds"]), "forward_backward": fb,
           "optimizer": float((bf16 or {}).get("optimizer_step_seconds") or 0.0),
           "paper": float(steps["agoq-paper"]["step_seconds"]) if "agoq-paper" in steps else None,
           "checkpoint_all": float(steps["checkpoint-all"]["step_seconds"]) if "checkpoint-all" in steps else None,
           "layer_forward": None}
    L = profile.num_layers
    if forward is not None and len(forward) == L:
        out["layer_forward"] = [float(f) for f in forward]
    elif out["checkpoint_all"] is not None and out["bf16"] is not None:
        out["layer_forward"] = [max(0.0, out["checkpoint_all"] - out["bf16"]) / L] * L
    return out


def compile_modes(profile: ProfileData) -> list[str]:
    """Compile modes the profile has step times for (its own mode first)."""
    modes = [profile_compile_mode(profile)]
    for mode in COMPILE_MODES:
        if mode not in modes:
            try:
                if mode_timing(profile, mode)["bf16"] is not None:
                    modes.append(mode)
            except ValueError:
                pass
    return modes


def _recipe_extra_seconds(profile: ProfileData) -> Optional[float]:
    """Sum of the profile's extra seconds (at the profiled micro-batch) over the options of the agoq-paper step
    the profiler measured (every layer at the preset's settings); None when one is missing from the table."""
    from agoq.activations.policy import as_policy

    policy = as_policy("agoq-paper")
    table = profile.table
    rows = table[table["format"].isin(["bf16", "recompute", "int"])]
    lookup = {(int(l), k, str(o)): float(e) for l, k, o, e in
              zip(rows["layer"], rows["kind"], rows["option"], rows["extra_seconds"])}
    total = 0.0
    for layer in range(profile.num_layers):
        for kind, setting in policy.settings(layer).items():
            key = (layer, kind, "recompute" if setting == RECOMPUTE else str(setting))
            if key not in lookup:
                return None
            total += lookup[key]
    return total


def laaq_layer_seconds(profile: ProfileData, timing: dict) -> Optional[float]:
    """Seconds (at the profiled micro-batch) a layer running LAAQ's functions adds beyond its options' extra
    seconds: (agoq-paper step - bf16 step - the recipe's extra seconds) / layers, from the measured steps of
    `timing`'s mode; None when the profile lacks one of them."""
    if timing["paper"] is None or timing["bf16"] is None:
        return None
    extras = _recipe_extra_seconds(profile)
    if extras is None:
        return None
    return (timing["paper"] - timing["bf16"] - extras) / profile.num_layers


def build_problem(profile: ProfileData, knobs: ProblemSettings = ProblemSettings(), *,
                  peak_margin: bool = True) -> ChoiceProblem:
    """The ChoiceProblem of a profile under `knobs` (see the module docstring for the cost models); `peak_margin`
    False leaves out the compiled peak margin (agoq.search.compiled_costs), which is calibrated with this model."""
    notes: list[str] = []
    L = profile.num_layers
    profiled_micro_batch = int(profile.settings.get("micro_batch", 1) or 1)
    mb = knobs.micro_batch or profiled_micro_batch
    block0 = int(profile.settings.get("block", 128) or 128)
    block = knobs.block or block0
    shape0, shape = _layer_shape(profile, profiled_micro_batch), _layer_shape(profile, mb)
    if shape0 is None and (mb != profiled_micro_batch or block != block0):
        raise ValueError("the profile has no model config: micro-batch and block size cannot differ from the "
                         "profiled ones")
    stages = np.array(knobs.layer_stage if knobs.layer_stage is not None else profile.layer_stage(), dtype=int)
    S = int(stages.max()) + 1
    in_flight = profile.in_flight(knobs.schedule)
    if len(in_flight) < S:
        raise ValueError(f"the profile has in-flight counts for {len(in_flight)} stage(s), the plan uses {S}")
    if knobs.gradient_mode not in gradient_modes(profile):
        raise ValueError(f"gradient mode {knobs.gradient_mode!r} needs figures the profile lacks "
                         f"(available: {', '.join(gradient_modes(profile))})")
    layout = resolve_layout(knobs.layout, knobs.gradient_mode)
    world = int(profile.settings.get("world_size", 1) or 1)
    if layout == "fsdp" and world < 2:
        raise ValueError("layout fsdp shards over several ranks: the profile was made for one (profile with "
                         "--world-size N)")
    if layout == "fsdp" and S > 1:
        raise ValueError(f"layout fsdp is data parallelism over one pipeline stage, the plan has {S} stages")
    if layout == "sharded":  # SDP4Bit's sharded step is always its own: unset knobs mean it
        optimizer, master = knobs.optimizer or "adamw8bit", knobs.master or "fp32"
        if (optimizer, master) != ("adamw8bit", "fp32"):
            raise ValueError("gradient mode sdp4bit runs SDP4Bit's sharded step, the fused 8-bit AdamW over float32 "
                             f"masters: optimizer adamw8bit, masters fp32 (not {optimizer}, masters {master})")
    else:
        optimizer, master = resolve_optimizer(profile, knobs.optimizer, knobs.master)
    timing = mode_timing(profile, knobs.compile_mode)
    if block != block0:
        notes.append(f"sensitivities were measured at block {block0}; at block {block} the same values are used")
    floors = knobs.floors()
    table = profile.table
    fmt_ok = table["format"].isin(["bf16", "recompute", "int"] + (["nf4"] if knobs.format == "nf4" else []))
    if knobs.format == "nf4":  # the codebook replaces the int 4-bit row where the profile measured one
        where = list(zip(table["layer"].astype(int), table["kind"]))
        has_nf4 = {w for w, f in zip(where, table["format"]) if f == "nf4"}
        fmt_ok &= ~((table["format"] == "int") & (table["bits"] == 4)
                    & np.array([w in has_nf4 for w in where], dtype=bool))
    rows = table[fmt_ok]
    rows = rows[np.array([(o in ("16", "recompute")) or int(o) >= floors.get(k, 0)
                          for o, k in zip(rows["option"], rows["kind"])], dtype=bool)]
    rows = rows.drop_duplicates(["layer", "kind", "option"]).sort_values(["layer", "kind", "option"]).copy()
    # o_proj_input at 16 shares attention's output while attention is 16: profiles give that shared size
    # as `bytes` and the full size as `bytes_unshared`; the full size is costed here and the sharing is
    # the per-layer credit below
    if "bytes_unshared" in rows.columns:
        full = pd.to_numeric(rows["bytes_unshared"], errors="coerce")
        rows["bytes"] = np.where(full.notna(), full, rows["bytes"])
    elif shape0 is not None:
        zero_16 = (rows["kind"] == "o_proj_input") & (rows["option"] == "16") & (rows["bytes"] == 0)
        rows.loc[zero_16, "bytes"] = _kind_bytes(shape0, "o_proj_input", KEEP, block0)

    cache: dict = {}

    def scale(kind: str, option: str) -> float:
        if shape0 is None or (mb == profiled_micro_batch and block == block0):
            return 1.0
        key = (kind, option)
        if key not in cache:
            setting = RECOMPUTE if option == "recompute" else int(option)
            before = _kind_bytes(shape0, kind, setting, block0)
            cache[key] = _kind_bytes(shape, kind, setting, block) / before if before else 0.0
        return cache[key]

    layer = rows["layer"].to_numpy(int)
    kind = np.array([KINDS.index(k) for k in rows["kind"]])
    option = [str(o) for o in rows["option"]]
    per_mb = np.array([b * scale(k, o) for b, k, o in zip(rows["bytes"], rows["kind"], option)], dtype=float)
    flight = np.array([in_flight[s] for s in stages], dtype=float)
    memory = per_mb * flight[layer]
    accum = int(knobs.grad_accum)
    time_scale = accum * mb / profiled_micro_batch
    compiled = timing["mode"] == "compiled"
    fb_points = timing["forward_backward"]
    efficiency = 1.0  # fb(mb) / (fb(m0) x mb / m0): > 1 where a smaller micro-batch runs each token slower
    if fb_points:
        fb0 = forward_backward_seconds(fb_points, profiled_micro_batch)
        efficiency = forward_backward_seconds(fb_points, mb) / (fb0 * mb / profiled_micro_batch) if fb0 > 0 else 1.0
        if mb != profiled_micro_batch and len(fb_points) == 1:
            notes.append(f"no {timing['mode']} step was measured at micro-batch {mb}: its fwd + bwd is taken as the "
                         f"profiled micro-batch's x {mb}/{profiled_micro_batch} (any per-micro-batch overhead unknown)")
    delta = compiled_layer_seconds(timing, L) if compiled else None
    if delta is not None:  # compiled: a LAAQ layer costs delta per micro-batch, its options nothing of their own
        seconds = np.zeros(len(rows))
    else:
        seconds = rows["extra_seconds"].to_numpy(float) * time_scale * efficiency
        if compiled:
            notes.append("no compiled agoq-paper step in the profile: compiled layers under LAAQ are timed with the "
                         "options' eager extra seconds")
    error = rows["sensitivity"].to_numpy(float)

    unmodified = np.zeros(L)
    credit = np.zeros(L)
    if shape is not None:
        plain = sum(predict_layer_bytes(shape, None, block).values())
        for l in range(L):
            sel = rows[(rows["layer"] == l) & (rows["option"] == "16")]
            by_kind = {k: b * scale(k, "16") for k, b in zip(sel["kind"], sel["bytes"])}
            credit[l] = by_kind.get("o_proj_input", 0.0) * flight[l]
            if len(by_kind) == len(KINDS):
                unmodified[l] = max(0.0, plain - (sum(by_kind.values()) - by_kind.get("o_proj_input", 0.0))) * flight[l]
    else:
        notes.append("no model config in the profile: layers left all at 16 bits are costed as the sum of their kinds")

    # a checkpointed layer reruns the unmodified forward in backward, keeping what the plain layer keeps
    recompute = np.full(L, float(sum(predict_layer_bytes(shape, None, block).values()))) if shape is not None else None
    hidden = shape.hidden if shape is not None else None
    elem = ELEM_BYTES.get(str(profile.settings.get("dtype", "bf16")), 2)
    if hidden is None:
        config = profile.model_config() or {}
        hidden = config.get("hidden_size")
    tokens = mb * int(profile.settings.get("seq_len", 1))
    checkpoint_memory = np.array([tokens * hidden * elem * flight[l] for l in range(L)], dtype=float) \
        if hidden else np.zeros(L)
    forward = timing["layer_forward"]
    bf16_step = timing["bf16"]
    allow_ckpt = knobs.allow_checkpoint and bool(hidden)
    if forward is not None and len(forward) == L:
        checkpoint_seconds = np.array(forward, dtype=float) * time_scale * efficiency
    elif bf16_step is not None:
        checkpoint_seconds = np.full(L, bf16_step / (3.0 * L)) * time_scale * efficiency
        notes.append("layer forward time estimated as a third of the bf16 step per layer (the profile has no "
                     "timing.layer_forward_seconds)")
    else:
        checkpoint_seconds = np.zeros(L)
        if allow_ckpt:
            notes.append("no layer forward time and no bf16 step time in the profile: whole-layer checkpointing "
                         "is not offered")
        allow_ckpt = False
    if not hidden and knobs.allow_checkpoint:
        notes.append("no hidden size in the profile: whole-layer checkpointing is not offered")

    share = np.bincount(stages, minlength=S) / L
    units = None
    state = state_per_rank(profile, knobs.gradient_mode, optimizer, master, layout)  # bytes per rank
    state_total = sum(state.values())
    static_parts = {name: value * share for name, value in state.items()}  # {part: [S] bytes}
    if layout == "fsdp":
        units = unit_sizes(profile.model_config(), int(profile.header["model"].get("parameters") or 0), L)
        in_flight_weights = fsdp_in_flight_bytes(units, knobs.gradient_mode)
        static_parts["fsdp_unsharded"] = in_flight_weights * share
        notes.append(f"fsdp over {world} ranks: {int(state_total)} bytes of sharded state per rank and "
                     f"{int(in_flight_weights)} bytes of unsharded weights and gradients in flight "
                     "(agoq.search.layouts)")
    calibrated = measured_with(profile)
    if knobs.gradient_mode == "quangrad8" and calibrated["gradients"] != "quangrad8":
        # fixed_bytes was calibrated on a step whose bf16 gradients mostly did not exist yet at its fwd + bwd peak
        # (fixed = measured - predicted counts that as a credit); QuanGrad's buffer is allocated before the step,
        # while backward still produces each bf16 gradient: the peak keeps the calibrated step's gradients and
        # the buffer too
        grads_calibrated = state_parts(profile, calibrated["gradients"], optimizer, master)["gradients"]
        static_parts["backward_gradients"] = grads_calibrated * share
        notes.append(f"QuanGrad's 8-bit gradient buffer is counted on top of the {calibrated['gradients']} gradients "
                     "the profile's fixed bytes were calibrated with (+"
                     f"{int(grads_calibrated)} bytes at the fwd + bwd peak)")
    # besides the layers' activations a step holds what embedding, final norm, head and loss keep
    # (outside_activation_bytes) and the calibrated rest (fixed_bytes: logits' gradient, workspace)
    outside = float(profile.memory.get("outside_activation_bytes") or 0)
    fixed_bytes = profile.memory.get("fixed_bytes")
    if fixed_bytes is None:  # not calibrated (no allocator statistics where it was profiled)
        notes.append("this profile was made on a device without allocator statistics (the CPU), so the memory "
                     "model could not measure the step's workspace (temporaries): predicted peaks count only "
                     "weights, gradients, optimizer state, activations and the LM head's modelled tensors "
                     f"(at least the {int(outside)} bytes kept outside the decoder layers); profile on the GPU you "
                     "will train on for peaks you can budget by")
    # the eager step's peak is the chunked loss's forward (agoq.models.step_peak): the head's tensors at this
    # micro-batch and the calibrated workspace (the gradient storage there is the QuanGrad correction above)
    head = head_shape_of(profile.memory, profile.model_config(), profiled_micro_batch,
                         int(profile.settings.get("seq_len", 1)), elem)
    static_parts["head_and_workspace"] = np.full(S, head_and_workspace_bytes(profile.memory, head, mb,
                                                                          profiled_micro_batch))
    static = sum(static_parts.values())
    # LAAQ's backward holds dequantized copies the memory model does not list: the agoq-paper step's
    # measured fwd + bwd peak beyond its prediction (both from the profile) is taken as that transient
    laaq = None
    paper = next((st for st in profile.memory.get("steps", []) or [] if st.get("policy") == "agoq-paper"), {})
    measured_fb = paper.get("measured_peak_bytes_forward_backward")
    predicted_fb = paper.get("predicted_peak_bytes_forward_backward")
    if measured_fb is not None and predicted_fb is not None:
        over = max(0.0, float(measured_fb) - float(predicted_fb)) * (mb / profiled_micro_batch)
        laaq = np.full(S, over)
        notes.append(f"LAAQ backward transient of {int(over)} bytes per stage, from the profile's agoq-paper step")
    fixed_opt = profile.memory.get("fixed_bytes_optimizer_step")
    floor, floor_parts = None, None
    if fixed_opt is not None:  # the optimizer step's peak: weights, gradients, state and its temporaries
        # fixed_opt was measured with the profile's optimizer: its transient is swapped for this optimizer's
        calibrated = measured_with(profile)
        transient = state_parts(profile, knobs.gradient_mode, optimizer, master)["step_transient"] \
            - state_parts(profile, knobs.gradient_mode, calibrated["optimizer"], calibrated["master"])["step_transient"]
        floor_parts = {name: value * share for name, value in state.items()}
        floor_parts["optimizer_step_workspace"] = (float(fixed_opt) + transient) * share
        floor = sum(floor_parts.values())
    base = 0.0
    laaq_seconds = 0.0
    fb = 0.0  # seconds of one micro-batch's bf16 fwd + bwd (0: not measured)
    if bf16_step is not None:
        # fwd + bwd: grad_accum x fb(micro-batch) (compiled_costs.forward_backward_seconds); the optimizer step
        # runs once, its time scaled by the bytes it moves under this optimizer against the measured one's
        # (agoq.optim.state_bytes.step_bytes_moved)
        moved = step_bytes_moved(optimizer, master, knobs.gradient_mode if knobs.gradient_mode != "sdp4bit" else "bf16")
        moved0 = step_bytes_moved(calibrated["optimizer"], calibrated["master"], calibrated["gradients"])
        fb = forward_backward_seconds(fb_points, mb) if fb_points else (bf16_step - timing["optimizer"]) * mb \
            / profiled_micro_batch
        optimizer_seconds = timing["optimizer"] * moved / moved0
        base = fb * accum + (optimizer_seconds / world if layout == "fsdp" else optimizer_seconds)
        per_layer = laaq_layer_seconds(profile, timing)
        if delta is not None:
            laaq_seconds = delta * accum
            notes.append(f"compiled: each layer under LAAQ adds {delta * 1e3:.3f} ms per micro-batch ((compiled "
                         "agoq-paper step - compiled bf16 step) / layers); its options add no seconds of their own")
        elif per_layer is None:
            notes.append("no agoq-paper step time in the profile: layers under LAAQ are timed as the plain layer "
                         "plus their options' extra seconds")
        else:
            laaq_seconds = per_layer * time_scale * efficiency
    else:
        notes.append("no bf16 step time in the profile: predicted step times count only the options' extras")
    params = float(profile.header["model"].get("parameters") or 0)
    if layout == "fsdp":
        parts = fsdp_exposed_seconds(profile.collectives, knobs.gradient_mode, units, L, fb)
        comm = accum * parts["exposed"]
        ag_ms, rs_ms = parts["all_gather_layer"] * 1e3, parts["reduce_scatter_layer"] * 1e3
        notes.append(f"fsdp communication: {comm:.4g} s per step not hidden by compute (all-gather {ag_ms:.3g} ms, "
                     f"reduce-scatter {rs_ms:.3g} ms per layer and micro-batch)")
    else:
        comm = _collective_seconds(profile, knobs.gradient_mode, params * 4) if params else 0.0
    if math.isnan(comm):
        notes.append(f"no collective timing for gradient mode {knobs.gradient_mode}: communication not counted")
        comm = 0.0
    problem = ChoiceProblem(layer, kind, option, memory, seconds, error, stages, checkpoint_memory,
                            checkpoint_seconds, allow_ckpt, unmodified, credit, static, base + comm, time_scale, notes,
                            floor, np.array(in_flight[:S], dtype=float), recompute, laaq, laaq_seconds,
                            static_parts, floor_parts)
    if peak_margin and compiled and S == 1 and profile.header.get("compiled"):
        margin, rows_ = compiled_peak_margin(profile, lambda policy: _own_peak(profile, policy))
        if margin > 0:
            problem.static_parts["compiled_margin"] = np.full(S, margin)
            problem.static_bytes = problem.static_bytes + margin
            worst = max(rows_, key=lambda r: r[1] - r[2])
            notes.append(f"compiled peak margin of {int(margin)} bytes: the memory model predicted the measured "
                         f"compiled {worst[0]} step at {int(worst[2])} bytes, it peaked at {int(worst[1])}")
        elif rows_:
            notes.append("compiled peaks: the memory model predicts each measured compiled step ("
                         + ", ".join(f"{p}: {m / p_ - 1:+.1%} measured vs predicted" for p, m, p_ in rows_)
                         + ") at or above its measured peak: no margin")
    return problem


def _own_peak(profile: ProfileData, policy: str) -> Optional[float]:
    """The memory model's peak (bytes, one stage) of a compiled section's step: `policy` ("bf16", "agoq-paper" or
    "checkpoint-all") at the profiled micro-batch, optimizer and gradient storage; None for another policy."""
    calibrated = measured_with(profile)
    problem = build_problem(profile, ProblemSettings(gradient_mode=calibrated["gradients"],
                                                     optimizer=calibrated["optimizer"], master=calibrated["master"],
                                                     compile_mode=profile_compile_mode(profile), layer_stage=tuple(
                                                         [0] * profile.num_layers)), peak_margin=False)
    L = problem.num_layers
    if policy == "bf16":
        figures = problem.evaluate(np.nonzero(problem.keeps_16bit())[0], np.zeros(L, dtype=bool))
    elif policy == "checkpoint-all":
        figures = problem.evaluate(np.array([], dtype=int), np.ones(L, dtype=bool))
    elif policy == "agoq-paper":
        chosen = recipe_choice(problem)
        if chosen is None:
            return None
        figures = problem.evaluate(chosen, np.zeros(L, dtype=bool))
    else:
        return None
    return float(max(figures["peak_bytes_per_stage"]))


def checkpointing_only(problem: ChoiceProblem) -> ChoiceProblem:
    """The same problem where each layer either keeps everything (16) or is checkpointed whole: the
    full-or-selective activation checkpointing that agoq competes with."""
    keep = np.array([o == "16" for o in problem.option])
    idx = np.nonzero(keep)[0]
    return replace(problem, layer=problem.layer[idx], kind=problem.kind[idx], option=[problem.option[i] for i in idx],
                   memory=problem.memory[idx], seconds=problem.seconds[idx], error=problem.error[idx],
                   notes=list(problem.notes))


def recipe_choice(problem: ChoiceProblem) -> Optional[np.ndarray]:
    """Option indices of the published LAAQ recipe (agoq-paper, each pipeline stage at the stage rule's
    bits) in `problem`, nothing checkpointed; None when the problem lacks one of its options (a floor or
    a profile without those bit widths)."""
    counts = [int(round(n)) for n in problem.in_flight_counts()]
    policy = stage_aware_policy(counts, problem.num_layers, [int(s) for s in problem.layer_stage])
    chosen = []
    for (layer, kind), options in sorted(problem.groups().items()):
        setting = policy.settings(layer)[KINDS[kind]]
        want = "recompute" if setting == RECOMPUTE else str(setting)
        match = [i for i in options if problem.option[i] == want]
        if not match:
            return None
        chosen.append(match[0])
    return np.array(chosen, dtype=int)


def recipe_error(problem: ChoiceProblem) -> Optional[float]:
    """The predicted gradient error of the published recipe (see `recipe_choice`); None when unavailable."""
    chosen = recipe_choice(problem)
    return None if chosen is None else float(problem.error[chosen].sum())


__all__ = ["ProblemSettings", "ChoiceProblem", "build_problem", "checkpointing_only", "gradient_modes", "recipe_choice",
           "recipe_error", "static_bytes_total", "state_parts", "mode_timing", "compile_modes", "optimizer_choices",
           "resolve_optimizer", "measured_with", "laaq_layer_seconds", "COMPILE_MODES"]
