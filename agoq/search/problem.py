"""The per-layer choice as data: `ProblemSettings` (the knobs outside the per-layer choice) and `ChoiceProblem`
(every option's memory, time and error, and how a choice of them adds up to a peak per stage, a step time and a
gradient error). agoq.search.costs builds a ChoiceProblem from a profile; the MILP (agoq.search.milp) solves it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np

from agoq.runtime.activations.policy import KINDS, RECOMPUTE, stage_aware_policy
from agoq.search import memory_phases
from agoq.search.memory_parts import stage_entry


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
    layout: Optional[str] = None          # replicated, fsdp or hsdp (agoq.search.layouts; None: the gradient
                                          # mode's own, fsdp for sdp4bit, else replicated)
    allow_offload: bool = True            # offer keeping layers' saved tensors in pinned host memory (where the
                                          # profile measured the host link and the layout can run it)
    host_budget: Optional[float] = None   # bytes of pinned host memory offload may hold (None: the profile's
                                          # pinnable bytes)
    quantize_attention: bool = True       # offer attention's quantized options (the search's requests default to
                                          # False: agoq.search.request.KnobSpace)
    weight_gather: str = "bf16"           # FSDP2's weight all-gather (`agoq train --weight-gather`): bf16, int8 or int4
                                          # block codes (layouts fsdp, hsdp)

    def floors(self) -> dict[str, int]:
        return dict(self.floor_bits)


@dataclass(frozen=True)
class OffloadPrices:
    """What keeping a layer's saved tensors in pinned host memory costs (agoq.runtime.activations.offload), per the profile's
    measured host link (agoq.profiler.host_link). Offloaded layers are a prefix (layers 0..K-1 of the one stage):
    their tensors leave first in forward and are needed last in backward.

      link seconds per micro-batch = B x link_seconds_per_byte          (B: bytes offloaded, out then back)
      exposed seconds per micro-batch = max(0, link seconds - window_seconds)
      step seconds += grad_accum x exposed + B x seconds_per_byte + K x layer_seconds   (K: layers offloaded)
      peak: offloaded layers keep nothing on the GPU at the end of forward, where what the link has not yet
            copied out is still on the GPU: + max(0, B - forward_link_bytes); backward's first prefetch starts when
            the top layer's backward does (agoq.runtime.activations.offload), the LM head's tensors freed and its gradients
            made, and brings back one layer before backward has freed anything: the start of backward (phase
            backward_start) adds the largest offloaded layer's bytes and the top layer's end_of_backward bytes
            (negative where the head's tensors outweigh its gradients) to the end of forward's peak, and so does
            the backward of a checkpointed layer
      host: B <= host_budget_bytes
      backward of an offloaded layer (phase offload_backward): the layer's tensors are back, the next offloaded
            layer's are on their way, and its backward allocates backward_bytes on top (dequantized copies and
            the gradients of its activations), after the gradients of the layers above it are made. At layer 0:
            static + e(0) + h + backward_bytes; at layer 1 (K >= 2): static + e(1) + the two largest offloaded
            layers' bytes + backward_bytes (exact for a prefix of alike layers; e(l) the end_of_backward bytes,
            which fall with l, so no higher layer holds more). Backward's fetch-ahead fills what backward has freed
            up to the start of backward's level, so a layer's backward there may add backward_bytes on top of the
            start of backward too: start of backward + backward_bytes
      floor: a choice that offloads any layer peaks at no less than floor_bytes (0: none known), the peak the
            profile measured for its offloading step, moved by the model's state bytes (agoq.search.calibration):
            with activations on the host the peak comes at the end of backward, every gradient made, which
            offload does not lower

    A copy back waits for the same tensor's copy out, so the two directions form one chain per tensor; the window
    is the decoder layers' forward and backward, under which the copies run (the profile's layer forward times x 3
    as a share of its eager bf16 step, applied to this step)."""

    link_seconds_per_byte: float   # 1 / d2h rate + 1 / h2d rate, s/B
    window_seconds: float          # per micro-batch
    seconds_per_byte: float        # per step (x accumulation): the compute slowdown while the copies run
    host_budget_bytes: float
    grad_accum: int = 1
    forward_link_bytes: float = float("inf")  # bytes the link copies out during one micro-batch's forward
    layer_seconds: float = 0.0     # per step, per offloaded layer: the runtime's own time (its hooks and copies per
                                   # tensor, every micro-batch) beyond the link model, measured (agoq.search.costs)
    floor_bytes: float = 0.0       # the least peak of a choice offloading any layer (measured; 0: none known)
    backward_bytes: float = 0.0    # what an offloaded layer's backward allocates beyond its fetched tensors (the
                                   # profile's offloading step's peak less the model's level there: calibration)


@dataclass
class ChoiceProblem:
    """Arrays describing every option (index i) and layer (index l); sizes in bytes, times in seconds."""

    layer: np.ndarray          # [n] layer of option i
    kind: np.ndarray           # [n] kind index (into KINDS) of option i
    option: list               # [n] "16", "8", ..., "recompute"
    memory: np.ndarray         # [n] bytes option i adds to its stage's peak (already x in-flight)
    seconds: np.ndarray        # [n] seconds option i adds per step
    error: np.ndarray          # [n] gradient error option i adds (and pairs of options more: pair_error)
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
    # [L] bytes the calibration on measured peaks adds per unmodified / checkpointed layer (agoq.search.calibration;
    # may be negative: a compiled layer keeps less than the model counts); apart from the layers' own bytes
    unmodified_calibration: Optional[np.ndarray] = None
    checkpoint_calibration: Optional[np.ndarray] = None
    # [L] bytes the calibration adds to the backward of checkpointed layer l (its checkpoint_backward phase): the
    # measured checkpoint-all step's miss there, which is not a per-layer amount (its peak holds one rerun layer)
    rerun_calibration: Optional[np.ndarray] = None
    # [L] what the backward of checkpointed layer l holds beyond `static_bytes`, which count the end of forward: the
    # bf16 gradients made by then where they are not in static_bytes (no accumulation), less the LM head's tensors,
    # freed by then (agoq.search.costs)
    end_of_backward: Optional[np.ndarray] = None
    one_setting_per_stage: bool = False  # every layer of a stage under LAAQ's functions has the same settings
                                         # (compiled: one graph for them, beside the unmodified and checkpointed)
    offload: Optional[OffloadPrices] = None  # None: offload is not offered
    communication_seconds: float = 0.0  # of base_seconds, what the layout's collectives leave exposed per step
    # error added by pairs of options chosen together (agoq.search.recompute_error): [m, 2] option indices, a recompute
    # option and a quantized option of its source kind in the same layer, and [m] the error the pair adds (> 0)
    pair_options: Optional[np.ndarray] = None
    pair_error: Optional[np.ndarray] = None

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """([m, 2] option indices, [m] error) of `pair_options` and `pair_error` (empty when none)."""
        if self.pair_options is None or self.pair_error is None or len(self.pair_error) == 0:
            return np.zeros((0, 2), dtype=int), np.zeros(0)
        return np.asarray(self.pair_options, dtype=int).reshape(-1, 2), np.asarray(self.pair_error, float)

    def error_terms(self, chosen: np.ndarray) -> np.ndarray:
        """Per chosen option (in `chosen`'s order), its gradient error term: its own error, and for a recompute
        option whose source's quantized option is chosen too, that pair's error (agoq.search.recompute_error). The
        terms of agoq.profiler.additivity.error_terms, one per (layer, kind) of the layers not checkpointed."""
        chosen = np.asarray(chosen, dtype=int)
        terms = np.asarray(self.error, float)[chosen].copy()
        pairs, error = self.pairs()
        if len(error) and len(chosen):
            position = np.full(len(self.option), -1)
            position[chosen] = np.arange(len(chosen))
            both = (position[pairs[:, 0]] >= 0) & (position[pairs[:, 1]] >= 0)
            np.add.at(terms, position[pairs[both, 0]], error[both])
        return terms

    def grad_error(self, chosen: np.ndarray) -> float:
        """The predicted gradient error of a choice: the sum of its `error_terms`."""
        return float(self.error_terms(chosen).sum())

    def pairs_within(self, idx: np.ndarray) -> dict:
        """`pair_options` and `pair_error` of the problem made of the options `idx` (in that order): the pairs whose
        two options are both in it, renumbered (keywords for ChoiceProblem or dataclasses.replace)."""
        pairs, error = self.pairs()
        position = np.full(len(self.option), -1)
        position[np.asarray(idx, dtype=int)] = np.arange(len(idx))
        kept = (position[pairs[:, 0]] >= 0) & (position[pairs[:, 1]] >= 0)
        return {"pair_options": position[pairs[kept]].reshape(-1, 2), "pair_error": error[kept]}

    def laaq_transient(self) -> np.ndarray:
        """Per stage, what the backward of a layer under LAAQ's functions holds beyond the memory model
        (dequantized copies), added when any layer of the stage is neither all-16 nor checkpointed."""
        if self.laaq_transient_bytes is None:
            return np.zeros(self.num_stages)
        return np.asarray(self.laaq_transient_bytes, float)

    def in_flight_counts(self) -> np.ndarray:
        return np.ones(self.num_stages) if self.in_flight is None else np.asarray(self.in_flight, float)

    def recomputed(self) -> np.ndarray:
        """[L] what the backward of checkpointed layer l adds to its stage's peak beyond the held activations: its
        rerun forward's bytes, the phase's own bytes (`end_of_backward`) and its calibration (`rerun_calibration`)."""
        return self._per_layer(self.recompute_bytes) + self.rerun_calibrated() + self.end_of_backward_bytes()

    def end_of_backward_bytes(self) -> np.ndarray:
        return self._per_layer(self.end_of_backward)

    def rerun_calibrated(self) -> np.ndarray:
        return self._per_layer(self.rerun_calibration)

    def top_layers(self) -> np.ndarray:
        """Per stage, its last decoder layer (the first that backward runs)."""
        top = np.zeros(self.num_stages, dtype=int)
        np.maximum.at(top, self.layer_stage, np.arange(self.num_layers))
        return top

    def _per_layer(self, values: Optional[np.ndarray]) -> np.ndarray:
        return np.zeros(self.num_layers) if values is None else np.asarray(values, float)

    def peak_floor(self) -> np.ndarray:
        """Per stage, the least peak whatever is chosen (the optimizer step's), bytes."""
        return np.zeros(self.num_stages) if self.floor_bytes is None else np.asarray(self.floor_bytes, float)

    @property
    def num_layers(self) -> int:
        return len(self.layer_stage)

    @property
    def num_stages(self) -> int:
        return len(self.static_bytes)

    def derived(self, name: str, make: Callable[[], Any]) -> Any:
        """What `make()` derives from this problem (its MILP's rows, its checkpointing-only twin), made once and kept
        while every field is still the object it was made from: the search's problems are built once per profile and
        knobs (agoq.search.costs) and solved by every solver of a request, and of later ones in the plan service."""
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        kept = self.__dict__.get("_derived", {}).get(name)
        if kept is not None and all(a is b for a, b in zip(kept[0], fields)):
            return kept[1]
        value = make()
        self.__dict__.setdefault("_derived", {})[name] = (fields, value)  # the fields held: no id of theirs reused
        return value

    def groups(self) -> dict[tuple[int, int], np.ndarray]:
        """(layer, kind index) -> indices of its options (read-only arrays: worked out once per problem, as pricing
        one plan asks for them hundreds of times)."""
        return dict(self.derived("groups", self._groups))

    def _groups(self) -> dict[tuple[int, int], np.ndarray]:
        out: dict[tuple[int, int], list[int]] = {}
        for i, (l, k) in enumerate(zip(self.layer, self.kind)):
            out.setdefault((int(l), int(k)), []).append(i)
        groups = {g: np.array(v) for g, v in out.items()}
        read_only(groups)
        return groups

    def keeps_16bit(self) -> np.ndarray:
        """Boolean mask of the '16' options."""
        return np.array([o == "16" for o in self.option])

    def offload_mask(self, offload) -> np.ndarray:
        """`offload` (None, or bool per layer) as a bool array [L]; refused where the problem offers no offload."""
        if offload is None:
            return np.zeros(self.num_layers, dtype=bool)
        mask = np.asarray(offload, dtype=bool)
        if mask.any() and self.offload is None:
            raise ValueError("this problem offers no offload (no host link measured, or a layout that cannot run it)")
        return mask

    def _memory(self, chosen: np.ndarray, ckpt: np.ndarray, offload=None) -> dict:
        """Per stage: the peak (bytes), the phase that sets it (agoq.search.memory_phases, which states every phase
        and its terms) with its layer; also the activations at the end of forward, the LAAQ transient, the number of
        layers running LAAQ, and with `offload` (bool per layer) the bytes on the host and the prefetch reserve per
        stage."""
        return memory_phases.evaluate(self, chosen, ckpt, offload)

    def offload_seconds(self, host_bytes: float, layers: int) -> dict:
        """The step seconds `host_bytes` offloaded per micro-batch by `layers` layers add, and the link's seconds
        (OffloadPrices)."""
        o = self.offload
        if o is None or host_bytes <= 0:
            return {"seconds": 0.0, "link_seconds": 0.0, "exposed_seconds": 0.0, "layer_seconds": 0.0}
        link = host_bytes * o.link_seconds_per_byte
        exposed = max(0.0, link - o.window_seconds)
        own = layers * o.layer_seconds
        return {"seconds": o.grad_accum * exposed + host_bytes * o.seconds_per_byte + own, "link_seconds": link,
                "exposed_seconds": exposed, "layer_seconds": own}

    def evaluate(self, chosen: np.ndarray, checkpoint: np.ndarray, offload=None) -> dict:
        """Memory per stage, step seconds and error of a choice.

        `chosen`: option indices (one per (layer, kind) of non-checkpointed layers); `checkpoint`: bool [L];
        `offload`: bool [L], layers whose saved tensors are kept in host memory (None: none).
        """
        chosen = np.asarray(chosen, dtype=int)
        ckpt = np.asarray(checkpoint, dtype=bool)
        m = self._memory(chosen, ckpt, offload)
        host = float(m["host"].sum())
        link = self.offload_seconds(host, int(self.offload_mask(offload).sum()))
        seconds = self.base_seconds + float(self.seconds[chosen].sum()) + float(self.checkpoint_seconds[ckpt].sum()) \
            + self.laaq_layer_seconds * m["laaq_layers"] + link["seconds"]
        return {"peak_bytes_per_stage": m["peak"], "step_seconds": seconds,
                "grad_error": self.grad_error(chosen),
                "activation_bytes_per_stage": [int(round(a)) for a in m["activations"]],
                "peak_phase_per_stage": m["phase"], "host_bytes": int(np.ceil(host)),
                "offload_link_seconds": link["link_seconds"], "offload_exposed_seconds": link["exposed_seconds"]}

    def memory_parts(self, chosen: np.ndarray, checkpoint: np.ndarray, offload=None) -> list[dict]:
        """Per stage, the phase that sets its peak and the parts of the peak then, in whole bytes adding up to the
        stage's `evaluate` peak (agoq.search.memory_phases.explain; a plan's `predicted.memory_per_stage`)."""
        if self.static_parts is None or (self.floor_bytes is not None and self.floor_parts is None):
            raise ValueError("this problem does not list the parts of its static bytes (build_problem's do)")
        explained = memory_phases.explain(self, np.asarray(chosen, dtype=int), np.asarray(checkpoint, dtype=bool),
                                          offload)
        return [stage_entry(s, phase, layer, parts, peak) for s, (phase, layer, parts, peak) in enumerate(explained)]

__all__ = ["ProblemSettings", "ChoiceProblem", "OffloadPrices"]


def read_only(values: dict) -> None:
    """Make the arrays among `values` (and among those of its dicts) read-only: what is shared, not to be changed."""
    for value in values.values():
        for array in (value.values() if isinstance(value, dict) else [value]):
            if isinstance(array, np.ndarray):
                array.flags.writeable = False


def checkpointing_only(problem: ChoiceProblem) -> ChoiceProblem:
    """The same problem where each layer either keeps everything (16) or is checkpointed whole: the
    full-or-selective activation checkpointing that agoq competes with (nothing offloaded)."""
    def twin() -> ChoiceProblem:
        idx = np.nonzero(problem.keeps_16bit())[0]
        return replace(problem, layer=problem.layer[idx], kind=problem.kind[idx],
                       option=[problem.option[i] for i in idx], memory=problem.memory[idx],
                       seconds=problem.seconds[idx], error=problem.error[idx], notes=list(problem.notes), offload=None,
                       **problem.pairs_within(idx))

    return problem.derived("checkpointing_only", twin)


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
    """The predicted gradient error of the published recipe (see `recipe_choice`), as any choice's
    (ChoiceProblem.grad_error: with its recomputes' terms from their 4-bit or wider sources); None when unavailable."""
    chosen = recipe_choice(problem)
    return None if chosen is None else problem.grad_error(chosen)
