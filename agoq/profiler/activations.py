"""Compare activation policies on one model: bytes kept for backward, gradient error, step time.

Each policy runs one forward + backward on the same batch; bytes are measured with saved-tensor hooks
(per decoder layer and kind) and set beside the prediction from shapes; gradients are compared with
the unmodified model's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.runtime.activations.laaq import apply_activation_policy, remove_activation_policy
from agoq.runtime.activations.policy import ActivationPolicy, as_policy
from agoq.runtime.activations.saved_bytes import track_saved_tensors


@dataclass
class PolicyReport:
    """One policy's figures: bytes per layer (measured and predicted), gradient error, step seconds."""

    policy: str
    layer_bytes: list[int]
    predicted_layer_bytes: list[int]
    by_kind: dict[str, int] = field(default_factory=dict)  # summed over layers, bytes
    grad_rel_error: float = 0.0  # relative L2 of all weight gradients vs the unmodified model
    step_seconds: float = 0.0  # median fwd+bwd wall time
    loss: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def prediction_error(self) -> float:
        """Largest relative difference between predicted and measured bytes of a layer."""
        return max(abs(p - m) / m for p, m in zip(self.predicted_layer_bytes, self.layer_bytes) if m)


def _timed_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = model(ids, labels)
    loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, float(loss.detach())


def compare_policies(model: nn.Module, policies: list[ActivationPolicy | str], ids: torch.Tensor,
                     labels: torch.Tensor, repeats: int = 3, progress=None) -> list[PolicyReport]:
    """Run each policy on (ids, labels) and report its figures; the model is left unmodified after.

    `model(ids, labels)` must return the loss. `progress`, if given, is called with each policy name.
    """
    cfg = model.config
    elem = next(model.parameters()).element_size()
    shape = LayerShape.from_config(cfg, ids.shape[0], ids.shape[1], elem)
    reference = None
    reports = []
    try:
        for raw in ["bf16"] + [p for p in policies if p != "bf16"]:
            policy = as_policy(raw)
            if progress:
                progress(policy.name)
            apply_activation_policy(model, policy)
            model.zero_grad(set_to_none=True)
            with track_saved_tensors(model) as log:
                loss = model(ids, labels)
            loss.backward()
            grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
            if reference is None:
                reference = grads
            num = sum(((grads[n] - reference[n]) ** 2).sum().item() for n in reference)
            den = sum((reference[n] ** 2).sum().item() for n in reference)
            times = sorted(_timed_step(model, ids, labels)[0] for _ in range(repeats))
            n_layers = len(log.by_layer)
            predicted = [sum(predict_layer_bytes(shape, None if policy.keeps_everything(i) else policy.settings(i),
                                                 policy.block).values()) for i in range(n_layers)]
            by_kind: dict[str, int] = {}
            for kinds in log.by_layer.values():
                for k, v in kinds.items():
                    by_kind[k] = by_kind.get(k, 0) + v
            report = PolicyReport(policy.name, [log.layer_total(i) for i in range(n_layers)], predicted, by_kind,
                                  (num / den) ** 0.5 if den else 0.0, times[len(times) // 2], float(loss.detach()))
            if raw == "bf16" and "bf16" not in policies:
                continue
            reports.append(report)
    finally:
        remove_activation_policy(model)
    return reports
