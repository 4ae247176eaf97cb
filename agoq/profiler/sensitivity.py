"""Sensitivity: how much the weight gradients of the whole model change when one (layer, kind) uses an option.

For each measurement, only decoder layer L keeps kind K with the option; everything else is kept at 16
bits *through the same LAAQ runtime*, so the numerical difference between LAAQ's fused layers and the
unmodified model (the noise floor) is not counted. A layer whose settings are all 16 would run the
unmodified model, so the reference sends every layer through LAAQ with one kind recomputed from its
16-bit source, which rebuilds the tensor that would have been kept (bit for bit on the CPU):
`ffn2_input` (SiLU*Mul output, rebuilt from gate and up) when K is a norm-side kind, else `qkv_input`
(RMSNorm output, rebuilt from the norm input), so the recomputed tensor never depends on K.

sensitivity = ||g - g_ref|| / ||g_ref|| over all weight gradients concatenated, averaged over batches
(fixed seeds). `measure_chunk` runs a list of measurements on one model; `chunk_task` does the same
from a plain description (for Ray workers, which build their own model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from agoq.profiler.model_source import load_model, next_token_loss, token_batches, vocab_size
from agoq.runtime.laaq import apply_activation_policy, remove_activation_policy
from agoq.runtime.policy import RECOMPUTE, ActivationPolicy
from agoq.runtime.saved_bytes import track_saved_tensors

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
        self.reference_bytes: dict[str, dict[int, dict[str, int]]] = {}  # reference kind -> layer -> kind -> bytes

    def _backward(self, ids: torch.Tensor, log_bytes: bool = False):
        self.model.zero_grad(set_to_none=True)
        if log_bytes:
            with track_saved_tensors(self.model) as log:
                loss = next_token_loss(self.model, ids)
        else:
            log, loss = None, next_token_loss(self.model, ids)
        loss.backward()
        return log

    def _use_reference(self, reference: str) -> None:
        if self._reference == reference:
            return
        self._reference, self._ref_grads, self._ref_norm2 = None, [], []
        apply_activation_policy(self.model, measurement_policy(None, reference, self.block))
        try:
            for i, ids in enumerate(self.batches):
                log = self._backward(ids, log_bytes=i == 0)
                if log is not None:
                    self.reference_bytes[reference] = {i: dict(k) for i, k in log.by_layer.items()}
                grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
                norm2 = sum(g.float().pow(2).sum().item() for g in grads if g is not None)
                self._ref_grads.append(grads)
                self._ref_norm2.append(norm2)
        finally:
            remove_activation_policy(self.model)
            self.model.zero_grad(set_to_none=True)
        self._reference = reference

    def measure(self, m: Measurement) -> tuple[float, int | None]:
        """(sensitivity, bytes the layer kept for the kind, measured by the saved-tensor tracker)."""
        reference = reference_kind(m.kind)
        self._use_reference(reference)
        if m.option == "16":
            return 0.0, self.reference_bytes[reference].get(m.layer, {}).get(m.kind, 0)
        error, log = self._error(measurement_policy(m, reference, self.block))
        return error, int(log.by_layer.get(m.layer, {}).get(m.kind, 0))

    def policy_error(self, policy: ActivationPolicy, reference: str = "ffn2_input") -> float:
        """Relative L2 error of all weight gradients under any `policy`, against every layer kept at 16
        bits through LAAQ (`reference` recomputed from its 16-bit source), mean over the batches."""
        self._use_reference(reference)
        return self._error(policy)[0]

    def _error(self, policy: ActivationPolicy):
        apply_activation_policy(self.model, policy)
        errors, first_log = [], None
        try:
            for i, ids in enumerate(self.batches):
                log = self._backward(ids, log_bytes=i == 0)
                first_log = first_log or log
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
        return sum(errors) / len(errors), first_log

    def release(self) -> None:
        """Drop the stored reference gradients."""
        self._reference, self._ref_grads, self._ref_norm2 = None, [], []


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def measure_chunk(meter: SensitivityMeter, measurements: list[Measurement], progress=None) -> list[dict]:
    """Run measurements in order; each result is a dict with the measurement's fields plus
    `sensitivity` and `bytes_measured`, or `error` (the measurement failed: OOM or an exception)."""
    ordered = sorted(measurements, key=lambda m: reference_kind(m.kind))  # one reference at a time
    out = []
    for m in ordered:
        try:
            sens, measured = meter.measure(m)
            out.append({**asdict(m), "sensitivity": sens, "bytes_measured": measured})
        except Exception as e:  # noqa: BLE001 - a failing measurement is recorded, the profile goes on
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            kind = "out of memory" if _is_oom(e) else type(e).__name__
            out.append({**asdict(m), "error": f"{kind}: {str(e).splitlines()[0] if str(e) else ''}"[:500]})
        if progress is not None:
            progress(1)
    meter.release()
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
    return measure_chunk(meter, [Measurement(**m) for m in measurements])
