"""Sensitivity: how much the weight gradients of the whole model change when one (layer, kind) uses an option.

For each measurement, only decoder layer L keeps kind K with the option; everything else is kept at 16
bits *through the same LAAQ runtime*, so the numerical difference between LAAQ's fused layers and the
unmodified model (the noise floor) is not counted. A layer whose settings are all 16 would run the
unmodified model, so the reference sends every layer through LAAQ with one kind recomputed from its
16-bit source, which rebuilds the tensor that would have been kept (bit for bit on the CPU):
`ffn2_input` (SiLU*Mul output, rebuilt from gate and up) when K is a norm-side kind, else `qkv_input`
(RMSNorm output, rebuilt from the norm input), so the recomputed tensor never depends on K.

sensitivity = ||g - g_ref|| / ||g_ref|| over all weight gradients concatenated, averaged over batches
(fixed seeds). `SensitivityMeter.measure` runs a measurement's real policy; `measure_chunk` runs a
list of them, replaying backward where that gives the same numbers (agoq.profiler.replay);
`chunk_task` does the same from a plain description (for Ray workers, which build their own model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from agoq.runtime.activations.laaq import apply_activation_policy, remove_activation_policy
from agoq.runtime.activations.policy import RECOMPUTE, ActivationPolicy
from agoq.runtime.activations.saved_bytes import track_saved_tensors
from agoq.profiler.model_source import (
    load_model,
    next_token_loss,
    token_batches,
    vocab_size,
)
from agoq.profiler.replay import LOCAL_KINDS, REPLAYABLE, ReplaySession

NORM_SIDE = ("norm_input", "qkv_input", "ffn1_input")


@dataclass(frozen=True)
class Measurement:
    """One sensitivity run: decoder layer, kind, and the option (text, as in profile.parquet) with its format."""

    layer: int
    kind: str
    option: str
    format: str

    def describe(self) -> str:
        return f"sensitivity layer={self.layer} kind={self.kind} option={self.option} format={self.format}"


def reference_kind(kind: str) -> str:
    """The kind the reference recomputes (from its 16-bit source) while `kind` is measured."""
    return "ffn2_input" if kind in NORM_SIDE else "qkv_input"


def measurement_policy(m: Measurement | None, reference: str, block: int) -> ActivationPolicy:
    """The policy of a measurement (None: the reference itself): `reference` recomputed in every layer,
    and layer m.layer's kind m.kind at m.option."""
    layers = {}
    if m is not None and m.option != "16":
        layers = {m.layer: {m.kind: RECOMPUTE if m.option == RECOMPUTE else int(m.option)}}
    return ActivationPolicy(default={reference: RECOMPUTE}, layers=layers, block=block,
                            format="nf4" if m is not None and m.format == "nf4" else "int",
                            name="sensitivity")


class SensitivityMeter:
    """Measures sensitivities on one model and a fixed list of token batches."""

    def __init__(self, model: nn.Module, batches: list[torch.Tensor], block: int = 128):
        self.model, self.batches, self.block = model, batches, block
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._reference: str | None = None
        self._ref_grads: list[list[torch.Tensor | None]] = []
        self._ref_norm2: list[float] = []

    def _backward(self, ids: torch.Tensor) -> None:
        self.model.zero_grad(set_to_none=True)
        next_token_loss(self.model, ids).backward()

    def _use_reference(self, reference: str) -> None:
        if self._reference == reference:
            return
        self._reference, self._ref_grads, self._ref_norm2 = None, [], []
        apply_activation_policy(self.model, measurement_policy(None, reference, self.block))
        try:
            for ids in self.batches:
                self._backward(ids)
                grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
                norm2 = sum(g.float().pow(2).sum().item() for g in grads if g is not None)
                self._ref_grads.append(grads)
                self._ref_norm2.append(norm2)
        finally:
            remove_activation_policy(self.model)
            self.model.zero_grad(set_to_none=True)
        self._reference = reference

    def measure(self, m: Measurement) -> float:
        """Sensitivity of one measurement by running its policy (a full forward + backward per batch)."""
        if m.option == "16":
            return 0.0
        reference = reference_kind(m.kind)
        self._use_reference(reference)
        return self._error(measurement_policy(m, reference, self.block))

    def policy_error(self, policy: ActivationPolicy, reference: str = "ffn2_input") -> float:
        """Relative L2 error of all weight gradients under any `policy`, against every layer kept at 16
        bits through LAAQ (`reference` recomputed from its 16-bit source), mean over the batches."""
        self._use_reference(reference)
        return self._error(policy)

    def _error(self, policy: ActivationPolicy):
        apply_activation_policy(self.model, policy)
        errors = []
        try:
            for i, ids in enumerate(self.batches):
                self._backward(ids)
                diff2 = torch.zeros((), dtype=torch.float64, device=self.batches[0].device)
                for p, r in zip(self.params, self._ref_grads[i]):
                    if p.grad is None and r is None:
                        continue
                    g = p.grad.float() if p.grad is not None else torch.zeros_like(r, dtype=torch.float32)
                    diff2 += (g - (r.float() if r is not None else 0.0)).pow(2).sum().double()
                norm2 = self._ref_norm2[i]
                errors.append((diff2.item() / norm2) ** 0.5 if norm2 > 0 else 0.0)
        finally:
            remove_activation_policy(self.model)
            self.model.zero_grad(set_to_none=True)
        return sum(errors) / len(errors)

    def release(self) -> None:
        """Drop the stored reference gradients."""
        self._reference, self._ref_grads, self._ref_norm2 = None, [], []


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _failure(e: BaseException) -> str:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    kind = "out of memory" if _is_oom(e) else type(e).__name__
    return f"{kind}: {str(e).splitlines()[0] if str(e) else ''}"[:500]


def measure_chunk(meter: SensitivityMeter, measurements: list[Measurement], progress=None,
                  method: str = "replay", notes: dict | None = None) -> list[dict]:
    """Measure every sensitivity of `measurements` on the meter's model and batches.

    method "replay": quantized options of every kind in REPLAYABLE are measured by replaying backward
    from one kept reference forward per batch (agoq.profiler.replay; the same numbers, much cheaper): one
    session per reference kind, and for attention its own session, whose forward keeps q, k, v raw
    (laaq.rerun_kept_attention), so that the other kinds' replays do not pay for rerunning attention in
    backward. Everything with method "policy" runs its real policy. Recompute options rebuild bit for bit
    the 16-bit tensor they would have kept (tests/profiler/test_sensitivity.py checks it on the CPU), so their
    sensitivity is 0 and method "replay" does not run them (a policy run measures only the backward's run-to-run
    noise, about 0.008 on one H200 for 96 full steps of the probe); the search takes 0 for them in any case
    (agoq.search.cost_model).
    Each result is a dict with the measurement's fields plus `sensitivity` and `bytes_measured` (what
    the saved-tensor tracker counted for that layer and kind on a real forward with the option), or
    `error` (the measurement failed: out of memory or an exception). `notes`, if given, receives
    "replay_noise_floor": the largest error of a replay with nothing quantized (0 when backward is
    deterministic), at each session's highest layer (`_note_noise_floor`).
    """
    if method not in ("replay", "policy"):
        raise ValueError(f"method must be 'replay' or 'policy', got {method!r}")
    step = 1.0 / len(meter.batches)
    errors: dict[Measurement, list[float]] = {m: [] for m in measurements}
    failed: dict[Measurement, str] = {}
    replayed = [m for m in measurements if method == "replay" and m.kind in REPLAYABLE
                and m.format in ("int", "nf4")]
    for m in measurements:
        if m in replayed:
            continue
        if method == "replay" and m.option == RECOMPUTE:  # exact by construction: not run (docstring)
            errors[m] = [0.0]
            if progress is not None:
                progress(1)
            continue
        try:
            errors[m] = [meter.measure(m)]
        except Exception as e:  # noqa: BLE001 - a failing measurement is recorded, the profile goes on
            failed[m] = _failure(e)
        if progress is not None:
            progress(1)
    meter.release()  # the policy runs' reference gradients; replays keep their own
    fallback: list[Measurement] = []  # replay could not run them: measured by their policy instead
    for reference, attention in sorted({(reference_kind(m.kind), m.kind == "attention") for m in replayed}):
        group = sorted((m for m in replayed if reference_kind(m.kind) == reference
                        and (m.kind == "attention") == attention), key=lambda m: m.layer)
        for ids in meter.batches:
            try:
                session = ReplaySession(meter.model, ids, measurement_policy(None, reference, meter.block),
                                        attention=attention)
            except Exception as e:  # noqa: BLE001
                for m in group:
                    if _is_oom(e):
                        failed.setdefault(m, _failure(e))
                    elif m not in fallback:
                        fallback.append(m)
                if progress is not None:
                    progress(step * len(group))
                continue
            for m in group:
                if m not in failed and m not in fallback:
                    try:
                        errors[m].append(session.error(m.layer, m.kind, int(m.option), m.format))
                    except Exception as e:  # noqa: BLE001
                        if _is_oom(e):
                            failed[m] = _failure(e)
                        else:
                            fallback.append(m)
                if progress is not None:
                    progress(step)
            if notes is not None:
                _note_noise_floor(session, group, notes)
            session.close()
            del session
    for m in fallback:
        try:
            errors[m] = [meter.measure(m)]
        except Exception as e:  # noqa: BLE001
            failed[m] = _failure(e)
    meter.release()
    if notes is not None and fallback:
        notes["replay_fallbacks"] = len(fallback)
    kept = _measured_bytes(meter, measurements)
    out = []
    for m in measurements:
        if m in failed:
            out.append({**asdict(m), "error": failed[m]})
        else:
            out.append({**asdict(m), "sensitivity": sum(errors[m]) / len(errors[m]),
                        "bytes_measured": kept.get((m.kind, m.option, m.format), {}).get(m.layer)})
    return out


def _note_noise_floor(session: ReplaySession, group: list[Measurement], notes: dict) -> None:
    """notes["replay_noise_floor"]: the largest error of a replay with nothing substituted, taken for each scope
    the group replays (from layer L down, or layer L's own parameters) at its highest layer only: the replay from
    the top runs every backward kernel a lower one runs, and the session still holds that layer's reference
    partial (the group runs by layer). A floor at every layer cost a replay per layer and scope."""
    for local in sorted({m.kind in LOCAL_KINDS for m in group}):
        layer = max(m.layer for m in group if (m.kind in LOCAL_KINDS) == local)
        try:
            floor = session.noise_floor(layer, local)
            notes["replay_noise_floor"] = max(notes.get("replay_noise_floor", 0.0), floor)
        except Exception:  # noqa: BLE001 - a diagnostic only
            pass


def _measured_bytes(meter: SensitivityMeter, measurements: list[Measurement]) -> dict:
    """(kind, option, format) -> layer -> bytes kept, from one tracked forward per option with the option
    in every layer (the other kinds at 16 in LAAQ's layer)."""
    from agoq.profiler.options import Option, layer_settings

    out = {}
    for kind, option, fmt in sorted({(m.kind, m.option, m.format) for m in measurements}):
        opt = Option(option, 16 if option == "16" else (0 if option == RECOMPUTE else int(option)), fmt)
        policy = ActivationPolicy(default=layer_settings(kind, opt), block=meter.block,
                                  format="nf4" if fmt == "nf4" else "int")
        apply_activation_policy(meter.model, policy)
        try:
            with track_saved_tensors(meter.model) as log, torch.enable_grad():
                next_token_loss(meter.model, meter.batches[0])  # forward only: the graph is dropped
            out[(kind, option, fmt)] = {i: int(k.get(kind, 0)) for i, k in log.by_layer.items()}
        except Exception:  # noqa: BLE001 - bytes stay unmeasured (null); the prediction is still there
            pass
        finally:
            remove_activation_policy(meter.model)
    return out


def chunk_task(job: dict, measurements: list[dict]) -> list[dict]:
    """Build the model described by `job` (spec, dtype, device, seed, batches, micro_batch, seq_len,
    block) and run `measurements` (dicts of Measurement fields) on it; for Ray workers."""
    device = job["device"]
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    model = load_model(job["spec"], dtype=job["dtype"], device=device, seed=job["seed"], num_layers=job.get("layers"))
    batches = token_batches(vocab_size(model), job["batches"], job["micro_batch"], job["seq_len"], job["seed"],
                            device)
    meter = SensitivityMeter(model, batches, job["block"])
    return measure_chunk(meter, [Measurement(**m) for m in measurements], method=job.get("method", "replay"))
