"""Cost models: memory (bytes), step time (seconds) and gradient error of a per-layer choice, from a Profile, before
their calibration on measured peaks (agoq.search.calibration; agoq.search.costs.build_problem applies it).

A `ChoiceProblem` lists, for every (layer, kind), its options with their memory, time and error, plus a
whole-layer `checkpoint` option per layer. Exactly one option is picked per (layer, kind), unless the
layer is checkpointed, in which case none is (the layer then keeps only its input).

  memory of stage s = in_flight[s] x (bytes the stage's layers keep per micro-batch)
                      + the stage's share of weights, gradients (by gradient mode), masters and moments (by
                        optimizer and masters: agoq.runtime.optim.state_bytes, as the profile records them)
                      + the rest of the eager step's peak (agoq.models.step_peak.head_and_workspace_bytes: the
                        chunked LM head's tensors at this micro-batch and the calibrated workspace), and for QuanGrad
                        the bf16 gradients the calibration step had not made yet at its peak
  step time         = the measured bf16 step at these knobs + per layer under LAAQ's functions dQ + per
                      checkpointed layer dC, all from measured steps at the same compile mode and batch split
                      (agoq.search.timing); knobs the profile measured no step for are not offered. The options
                      of a layer under LAAQ have no seconds of their own: compiled, they run inside the layer's
                      graph; eager, the layer's fused functions cost what the agoq-paper step measured whatever its
                      bits (a plan quantizing one kind per layer measured 127.1 ms where the agoq-paper step
                      measured 127.8 and the kernel times summed per option had priced it at 109.6)
  error             = sum of the chosen options' measured sensitivities (0 for 16, recompute, checkpoint), plus
                      for each kind recomputed from a source stored at b bits the kind's own sensitivity at b bits
                      (agoq.search.recompute_error: pairs of options)

A stage's peak is the largest of the end of forward (above), the backward of each checkpointed layer and the
optimizer step (the state and its workspace); `ChoiceProblem.memory_parts` gives the phase that sets it and the
peak's parts then (agoq.search.memory_parts; the model state per rank is agoq.search.state's), which a plan
records and the dashboard draws.

Layouts over several ranks (agoq.search.layouts): replicated (DDP) keeps the whole state per rank and pays one
gradient all-reduce per step; fsdp (FSDP2, with sdp4bit gradients agoq's TLq-HS and int8/int4 weight gather)
keeps 1/N of everything plus the unsharded units in flight, its communication priced per micro-batch with the
overlap that module states, and its optimizer step over 1/N of the state; hsdp (FSDP2 over replicas across
nodes of a node's S shards, agoq.search.hsdp) the same within the node, 1/S, plus the all-reduce of each unit's
shard across nodes.

Gradients: fixed bytes are calibrated on a bf16-gradient step, at whose fwd + bwd peak most gradients did not exist
yet. QuanGrad's buffer is allocated before the step, so a quangrad8 plan's fwd + bwd peak counts the buffer on top
of the calibrated step's gradients; with bf16 gradients and several micro-batches per step, the gradients of the
first micro-batch are kept through the others' forward and backward, so they count too.

The model's peaks are then calibrated on the peaks the profile measured (agoq.search.calibration): per compile mode
and batch split, what unmodified, LAAQ and checkpointed layers really keep (compiled layers keep less than the eager
bytes), and a margin learnt from how far the calibrated model missed the profile's other measured steps.

Two per-layer corrections keep the memory model exact for agoq's runtime: a layer whose kinds are all 16
runs unmodified and keeps what the plain model keeps (float32 norm statistics and all: `unmodified_extra`),
and with attention and o_proj_input both at 16 the o_proj input is a view of attention's output, so it
costs nothing (`shared_credit`). Both are computed with the runtime's byte predictor from the profile's
model config.

`model_problem` reads top to bottom as its steps: resolve the knobs, the offered rows and their arrays, the 16-bit
corrections, checkpointing, the static bytes, LAAQ's transient and the optimizer step's peak (agoq.search.cost_memory),
and the step's seconds with the layout's communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.runtime.activations.policy import KEEP, KINDS, RECOMPUTE
from agoq.formats.measured_steps import COMPILE_MODES
from agoq.formats.profile import ProfileData
from agoq.models.step_peak import head_peak_bytes
from agoq.search.collective_times import collective_seconds, has_collective
from agoq.search.cost_memory import end_of_backward, laaq_transient, optimizer_floor, stage_share, static_bytes
from agoq.search.layouts import fsdp_exposed_seconds, resolve_layout, unit_sizes
from agoq.search.hsdp import hsdp_exposed_seconds, hsdp_refusal
from agoq.vocabulary import FSDP2_LAYOUTS
from agoq.search.offload_prices import offload_prices
from agoq.search.problem import ChoiceProblem, ProblemSettings
from agoq.search.recompute_error import recompute_pairs
from agoq.search.timing import EAGER_SPREAD_NOTE, prices, profile_compile_mode
from agoq.search.state import resolve_optimizer


ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
COMM_PATHS = {"bf16": "nccl-bf16", "quangrad8": "quangrad8", "sdp4bit": "sdp4bit"}


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
    """Seconds the gradient collective of `mode` takes for `message_bytes` fp32 bytes under a replicated
    layout (agoq.search.collective_times): bf16 and quangrad8 all-reduce (where the table has the
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
    if profile.world_size > 1:
        modes.append("sdp4bit")
    return modes


def _option_rows(profile: ProfileData, knobs: ProblemSettings, shape0, block0: int) -> pd.DataFrame:
    """The profile's rows a plan under `knobs` may choose from: its format (nf4 replaces the int 4-bit row where
    measured), no quantized option below the floors (nor of attention unless `knobs.quantize_attention`), one row
    per (layer, kind, option), full o_proj_input bytes."""
    floors = knobs.floors()
    table = profile.table
    fmt_ok = table["format"].isin(["bf16", "recompute", "int"] + (["nf4"] if knobs.format == "nf4" else []))
    if knobs.format == "nf4":  # the codebook replaces the int 4-bit row where the profile measured one
        where = list(zip(table["layer"].astype(int), table["kind"]))
        has_nf4 = {w for w, f in zip(where, table["format"]) if f == "nf4"}
        fmt_ok &= ~((table["format"] == "int") & (table["bits"] == 4)
                    & np.array([w in has_nf4 for w in where], dtype=bool))
    rows = table[fmt_ok]
    rows = rows[np.array([(o in ("16", "recompute")) or (int(o) >= floors.get(k, 0)
                                                          and (knobs.quantize_attention or k != "attention"))
                          for o, k in zip(rows["option"], rows["kind"])], dtype=bool)]
    rows = rows.drop_duplicates(["layer", "kind", "option"]).sort_values(["layer", "kind", "option"]).copy()
    # o_proj_input at 16 shares attention's output while attention is 16: profiles give that shared size
    # as `bytes` and the full size as `bytes_unshared`; the full size is costed here and the sharing is
    # the per-layer credit of build_problem
    if "bytes_unshared" in rows.columns:
        full = pd.to_numeric(rows["bytes_unshared"], errors="coerce")
        rows["bytes"] = np.where(full.notna(), full, rows["bytes"])
    elif shape0 is not None:
        zero_16 = (rows["kind"] == "o_proj_input") & (rows["option"] == "16") & (rows["bytes"] == 0)
        rows.loc[zero_16, "bytes"] = _kind_bytes(shape0, "o_proj_input", KEEP, block0)
    return rows


def _step_times(profile: ProfileData, knobs: ProblemSettings, compile_mode: str, mb: int, accum: int,
                optimizer: str, master: str, notes: list) -> dict:
    """The measured-step prices of agoq.search.timing for these knobs: the bf16 step ("base"), seconds per layer
    under LAAQ's functions ("laaq", None: not measured here) and per checkpointed layer ("checkpoint", None: not
    measured here)."""
    sp = prices(profile)
    row_gradients = "quangrad8" if knobs.gradient_mode == "quangrad8" else "bf16"
    why = sp.missing(compile_mode, mb, accum, row_gradients, optimizer, master)
    if why is not None:
        raise ValueError(f"{why}: a plan with these knobs is not offered (profile it, or ask for knobs it measured)")
    base = sp.seconds(compile_mode, mb, accum, row_gradients, optimizer, master)
    laaq = sp.per_layer(compile_mode, "agoq-paper", mb, accum)
    if laaq is None:
        notes.append(f"no {compile_mode} agoq-paper step was measured at micro-batch {mb} x {accum}: no layer is "
                     "quantized or recomputed at these knobs")
    checkpoint = sp.per_layer(compile_mode, "checkpoint-all", mb, accum)
    if checkpoint is None and knobs.allow_checkpoint:
        notes.append(f"no {compile_mode} checkpoint-all step was measured at micro-batch {mb} x {accum}: no layer is "
                     "checkpointed at these knobs")
    if checkpoint is not None and checkpoint < 0:
        # a checkpointed layer runs its forward twice: measured faster than kept is the measurement's noise (a loaded
        # CPU), which would price a checkpointed step below the bf16 one, or below nothing
        notes.append(f"the {compile_mode} checkpoint-all step measured faster than bf16 at micro-batch {mb} x {accum} "
                     f"({checkpoint * 1e3:.3g} ms per layer): noise, a checkpointed layer is priced at no extra time")
        checkpoint = 0.0
    spread = sp.spread(compile_mode, mb, accum) if compile_mode == "eager" else None
    if spread is not None and spread[0] > EAGER_SPREAD_NOTE:
        wide, row = spread
        steady = sp.steady(row)
        notes.append(f"eager steps at micro-batch {mb} x {accum} ranged {wide:.0%} within their measured runs (the "
                     f"{row['policy']} step: {min(steady) * 1e3:.1f}-{max(steady) * 1e3:.1f} ms): an eager step is "
                     "set by the host, and a run may miss its predicted step by as much")
    return {"base": base, "laaq": laaq, "checkpoint": checkpoint}


@dataclass(frozen=True)
class _Run:
    """What a plan under given knobs runs, resolved against the profile: micro-batch (`mb`, sequences) and block
    size against the profiled ones, their layer shapes (None: no usable model config), each layer's pipeline stage,
    the micro-batches in flight per stage, the layout, optimizer, masters and compile mode."""
    mb: int
    profiled_mb: int
    accum: int
    block: int
    block0: int
    shape: Optional[LayerShape]
    shape0: Optional[LayerShape]
    stages: np.ndarray
    in_flight: list
    layout: str
    optimizer: str
    master: str
    compile_mode: str
    elem: int
    one_rank: bool = False  # one-rank FSDP2 (model_problem's `one_rank`): fsdp at one rank, nothing communicated

    @property
    def num_stages(self) -> int:
        return int(self.stages.max()) + 1

    @property
    def flight(self) -> np.ndarray:
        """[L] micro-batches in flight at each layer's stage."""
        return np.array([self.in_flight[s] for s in self.stages], dtype=float)


def _resolve(profile: ProfileData, knobs: ProblemSettings, one_rank: bool = False) -> _Run:
    """The knobs resolved against the profile; ValueError, saying what to change, for knobs it cannot price.
    `one_rank` (model_problem's) lets layout fsdp with bf16 or sdp4bit gradients be priced on a profile of one
    rank."""
    one_rank = one_rank and profile.world_size == 1
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
    if knobs.gradient_mode not in gradient_modes(profile) and not (one_rank and knobs.gradient_mode == "sdp4bit"):
        raise ValueError(f"gradient mode {knobs.gradient_mode!r} needs figures the profile lacks "
                         f"(available: {', '.join(gradient_modes(profile))})")
    layout = resolve_layout(knobs.layout, knobs.gradient_mode)
    if layout == "fsdp" and profile.world_size < 2 and not one_rank:
        raise ValueError("layout fsdp shards over several ranks: the profile was made for one (profile with "
                         "--world-size N)")
    if layout == "hsdp":
        refusal = hsdp_refusal(profile.world_size, profile.node_size, profile.collectives, knobs.gradient_mode, S)
        if refusal:
            raise ValueError(f"layout hsdp is not offered here: {refusal}")
    if layout == "fsdp" and S > 1:
        raise ValueError(f"layout fsdp is data parallelism over one pipeline stage, the plan has {S} stages")
    if knobs.weight_gather != "bf16" and layout not in FSDP2_LAYOUTS:
        raise ValueError(f"weight gather {knobs.weight_gather} quantizes FSDP2's weight all-gather: layout fsdp or "
                         f"hsdp only, not {layout}")
    optimizer, master = resolve_optimizer(profile, knobs.optimizer, knobs.master)
    compile_mode = knobs.compile_mode or profile_compile_mode(profile)
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    elem = ELEM_BYTES.get(str(profile.settings.get("dtype", "bf16")), 2)
    return _Run(mb, profiled_micro_batch, int(knobs.grad_accum), block, block0, shape, shape0, stages, in_flight,
                layout, optimizer, master, compile_mode, elem, one_rank and layout == "fsdp")


def _offered_rows(profile: ProfileData, knobs: ProblemSettings, run: _Run, laaq_measured: bool,
                  notes: list) -> pd.DataFrame:
    """The option rows a plan may choose from (`_option_rows`, cached per profile, format, floors, block and
    attention), only the 16-bit ones where no LAAQ step was measured at these knobs."""
    if run.block != run.block0:
        notes.append(f"sensitivities were measured at block {run.block0}; at block {run.block} the same values are "
                     "used")
    if not knobs.quantize_attention:
        notes.append("attention is kept at 16 bits, as in agoq-paper: the profile measures sensitivities on fresh "
                     "weights, where attention's are far lower than after training (--quantize-attention on offers "
                     "its bit widths)")
    key = (id(profile.table), knobs.format, tuple(sorted(knobs.floors().items())), run.block0,
           knobs.quantize_attention)
    cached = profile.cache.setdefault("option_rows", {})  # one profile's rows per format, floors, attention
    if key not in cached:
        cached[key] = _option_rows(profile, knobs, run.shape0, run.block0)
    rows = cached[key]
    return rows if laaq_measured else rows[rows["option"] == "16"].copy()


def _byte_scale(run: _Run):
    """scale(kind, option): a kind's bytes at the plan's micro-batch and block over its bytes at the profiled ones
    (the runtime's byte predictor; 1 where they are the profiled ones or the profile has no model config)."""
    cache: dict = {}

    def scale(kind: str, option: str) -> float:
        if run.shape0 is None or (run.mb == run.profiled_mb and run.block == run.block0):
            return 1.0
        key = (kind, option)
        if key not in cache:
            setting = RECOMPUTE if option == "recompute" else int(option)
            before = _kind_bytes(run.shape0, kind, setting, run.block0)
            cache[key] = _kind_bytes(run.shape, kind, setting, run.block) / before if before else 0.0
        return cache[key]
    return scale


def _layer_options(rows: pd.DataFrame, run: _Run, scale) -> dict:
    """The per-(layer, kind) options' arrays: layer, kind (index in KINDS), option (str), memory (bytes per micro-batch
    x the layer's stage's micro-batches in flight), seconds (0: a layer's options are priced by its layer's dQ, the
    module docstring) and error (the measured sensitivity, 0 for recompute)."""
    layer, kinds, row_bytes = rows["layer"].to_numpy(int), rows["kind"].tolist(), rows["bytes"].tolist()  # (lists)
    option = [str(o) for o in rows["option"].tolist()]
    per_mb = np.array([b * scale(k, o) for b, k, o in zip(row_bytes, kinds, option)], dtype=float)
    # recompute rebuilds the tensor from its 16-bit source exactly (bit for bit on the CPU, tests/runtime/activations/
    # test_laaq.py; what a GPU profile read is the noise of nondeterministic backward kernels); from a quantized source
    # it carries the source's error: pairs of options (agoq.search.recompute_error)
    error = np.where(np.array(option) == RECOMPUTE, 0.0, rows["sensitivity"].to_numpy(float))
    return {"layer": layer, "kind": np.array([KINDS.index(k) for k in kinds]), "option": option,
            "memory": per_mb * run.flight[layer], "seconds": np.zeros(len(rows)), "error": error}


def _sixteen_corrections(rows: pd.DataFrame, run: _Run, scale, L: int, notes: list):
    """([L] unmodified_extra, [L] shared_credit) in bytes (the module docstring): a layer with every kind at 16 keeps
    the plain layer's bytes less its kinds' sum (o_proj_input's aside), and o_proj_input at 16 is credited while
    attention is 16; both x the stage's micro-batches in flight. Zeros without a model config."""
    unmodified, credit = np.zeros(L), np.zeros(L)
    if run.shape is None:
        notes.append("no model config in the profile: layers left all at 16 bits are costed as the sum of their kinds")
        return unmodified, credit
    flight = run.flight
    plain = sum(predict_layer_bytes(run.shape, None, run.block).values())
    sixteen: dict[int, dict[str, float]] = {}  # per layer, its kinds' bytes at 16
    for l, k, o, b in zip(rows["layer"].to_numpy(int), rows["kind"].tolist(), [str(o) for o in rows["option"].tolist()],
                          rows["bytes"].tolist()):
        if o == "16":
            sixteen.setdefault(int(l), {})[k] = b * scale(k, "16")
    for l in range(L):
        by_kind = sixteen.get(l, {})
        credit[l] = by_kind.get("o_proj_input", 0.0) * flight[l]
        if len(by_kind) == len(KINDS):
            unmodified[l] = max(0.0, plain - (sum(by_kind.values()) - by_kind.get("o_proj_input", 0.0))) * flight[l]
    return unmodified, credit


def _checkpoint_prices(profile: ProfileData, knobs: ProblemSettings, run: _Run, seconds: Optional[float], L: int,
                       notes: list) -> dict:
    """Whole-layer checkpointing: a checkpointed layer keeps its input (tokens x hidden x element bytes x in flight)
    and reruns the unmodified forward in backward, holding what the plain layer keeps ("recompute", [L] bytes; None
    without a model config); it costs `seconds` per layer (the measured checkpoint-all step; 0 where not measured).
    Offered where allowed, the hidden size known and the step measured."""
    recompute = np.full(L, float(sum(predict_layer_bytes(run.shape, None, run.block).values()))) \
        if run.shape is not None else None
    hidden = run.shape.hidden if run.shape is not None else None
    if hidden is None:
        config = profile.model_config() or {}
        hidden = config.get("hidden_size")
    tokens = run.mb * int(profile.settings.get("seq_len", 1))
    flight = run.flight
    memory = np.array([tokens * hidden * run.elem * flight[l] for l in range(L)], dtype=float) \
        if hidden else np.zeros(L)
    allow = knobs.allow_checkpoint and bool(hidden) and seconds is not None
    if not hidden and knobs.allow_checkpoint:
        notes.append("no hidden size in the profile: whole-layer checkpointing is not offered")
    return {"memory": memory, "seconds": np.full(L, seconds if seconds is not None else 0.0), "allow": allow,
            "recompute": recompute}


def _step_seconds(profile: ProfileData, knobs: ProblemSettings, run: _Run, base: float, units, L: int,
                  notes: list) -> tuple[float, float]:
    """(compute seconds, exposed communication seconds) of the bf16 step at these knobs.

    replicated: the measured step `base` and one gradient collective of 4 bytes per parameter per step.
    fsdp (FSDP2): accum x fb + once / N (each rank steps 1/N of the state; fb, once: the measured step's forward +
    backward and its once-per-step rest) and accum x the communication each micro-batch does not hide behind the
    layers' compute (agoq.search.layouts.fsdp_exposed_seconds); hsdp: accum x fb + once / S (the node's ranks) and
    agoq.search.hsdp.hsdp_exposed_seconds per step; one-rank FSDP2 (`run.one_rank`): accum x fb + once and no
    communication (one rank moves nothing). Communication the profile has no timing for is 0."""
    if run.layout in FSDP2_LAYOUTS:
        split = prices(profile).split_parts(run.compile_mode, run.mb, "bf16", run.optimizer, run.master)
        if split is None:
            raise ValueError(f"the profile measured no {run.compile_mode} steps of one and two micro-batches of "
                             f"{run.mb} sequences: an {run.layout} plan's compute and optimizer step cannot be told "
                             "apart")
        fb, once = split
        if run.layout == "hsdp":  # sharded within a node (agoq.search.hsdp)
            base = run.accum * fb + once / profile.node_size
            parts = hsdp_exposed_seconds(profile.collectives, knobs.gradient_mode, units, L, fb, run.accum,
                                         knobs.weight_gather)
            comm = parts["exposed"]
        elif run.one_rank:
            notes.append("one-rank FSDP2: no communication (the anchor of a what-if's fsdp calibration)")
            return run.accum * fb + once, 0.0
        else:
            base = run.accum * fb + once / profile.world_size
            parts = fsdp_exposed_seconds(profile.collectives, knobs.gradient_mode, units, L, fb, knobs.weight_gather)
            comm = run.accum * parts["exposed"]
        ag_ms, rs_ms = parts["all_gather_layer"] * 1e3, parts["reduce_scatter_layer"] * 1e3
        across = f", all-reduce across nodes {parts['all_reduce_layer'] * 1e3:.3g} ms" if "all_reduce_layer" in parts \
            else ""
        notes.append(f"{run.layout} communication: {comm:.4g} s per step not hidden by compute (all-gather "
                     f"{ag_ms:.3g} ms, reduce-scatter {rs_ms:.3g} ms{across} per layer and micro-batch)")
    else:
        params = float(profile.header["model"].get("parameters") or 0)
        comm = _collective_seconds(profile, knobs.gradient_mode, params * 4) if params else 0.0
    if math.isnan(comm):
        notes.append(f"no collective timing for gradient mode {knobs.gradient_mode}: communication not counted")
        comm = 0.0
    return base, comm


def model_problem(profile: ProfileData, knobs: ProblemSettings = ProblemSettings(), *,
                  one_rank: bool = False) -> ChoiceProblem:
    """The ChoiceProblem of a profile under `knobs` (see the module docstring for the cost models), before its
    calibration on the profile's measured peaks (agoq.search.calibration; agoq.search.costs.build_problem does both).
    Raises ValueError for knobs the profile cannot price. `one_rank`: on a profile of one rank, layout fsdp is priced
    as one-rank FSDP2 (the whole state on the one rank, no collectives), the anchor of a what-if's calibration on a
    one-rank layout step (agoq.search.layout_calibration); the search never plans it (fsdp needs several ranks)."""
    notes: list[str] = []
    L = profile.num_layers
    run = _resolve(profile, knobs, one_rank)
    S = run.num_stages
    times = _step_times(profile, knobs, run.compile_mode, run.mb, run.accum, run.optimizer, run.master, notes)
    rows = _offered_rows(profile, knobs, run, times["laaq"] is not None, notes)
    scale = _byte_scale(run)
    options = _layer_options(rows, run, scale)
    unmodified, credit = _sixteen_corrections(rows, run, scale, L, notes)
    ckpt = _checkpoint_prices(profile, knobs, run, times["checkpoint"], L, notes)

    units = unit_sizes(profile.model_config(), int(profile.header["model"].get("parameters") or 0), L) \
        if run.layout in FSDP2_LAYOUTS else None
    static_parts, state, head = static_bytes(profile, knobs.gradient_mode, run.optimizer, run.master, run.layout,
                                             run.accum, run.stages, units, run.elem, run.mb, notes)
    head_bytes = float(head_peak_bytes(head.with_micro_batch(run.mb))) if head is not None else 0.0
    backward = end_of_backward(profile, knobs.gradient_mode, run.accum, run.layout, state["gradients"], run.stages,
                               head_bytes)
    laaq = laaq_transient(profile, run.mb, S, notes)
    floor, floor_parts = optimizer_floor(profile, knobs.gradient_mode, run.optimizer, run.master, state,
                                         stage_share(run.stages))
    base, comm = _step_seconds(profile, knobs, run, times["base"], units, L, notes)
    offload = offload_prices(profile, knobs, base + comm, run.accum, S, run.layout, notes, run.compile_mode, run.mb)
    return ChoiceProblem(options["layer"], options["kind"], options["option"], options["memory"], options["seconds"],
                         options["error"], run.stages, ckpt["memory"], ckpt["seconds"], ckpt["allow"], unmodified,
                         credit, sum(static_parts.values()), base + comm, 1.0, notes, floor,
                         np.array(run.in_flight[:S], dtype=float), ckpt["recompute"], laaq, times["laaq"] or 0.0,
                         static_parts, floor_parts, one_setting_per_stage=run.compile_mode == "compiled",
                         end_of_backward=backward, offload=offload, communication_seconds=float(comm),
                         **recompute_pairs(profile, knobs.format, options))


__all__ = ["model_problem", "gradient_modes", "ELEM_BYTES"]
