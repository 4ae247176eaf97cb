"""The memory model of a training step, and the measured peak of real steps to calibrate it.

    peak = weights + masters + gradients + optimizer state + activations kept for backward + fixed

The step is `agoq train --optimizer adamw8bit`'s: bf16 parameters, the fused 8-bit AdamW
(agoq.runtime.optim.adamw8bit.FusedAdamW8bit) with float32 masters in its state, bf16 gradients dropped after every
step (set to None) and the loss from the chunked LM head (agoq.models.lm_loss) where the model is agoq's.
Weights, masters, gradients and moments are counted by agoq.runtime.optim.state_bytes (the section records them for
every optimizer, master and gradient storage, so the search can price the others); activations are the per-layer bytes of the profile
(predict_layer_bytes, equal to the saved-tensor tracker's count) plus what the embedding, final norm,
LM head and loss keep (measured by the tracker); `fixed` is everything else (the allocator's
workspace, gradients not yet allocated at the peak), calibrated as measured - predicted on the bf16
step and then used to predict the other policies.

On a GPU the peak is torch.cuda.max_memory_allocated over one fwd + bwd + AdamW step after a warm-up
step, read separately for the fwd + bwd part and the optimizer step. On the CPU there is no allocator statistic, so measured peaks and `fixed` are left null
(not measured) and only the activation bytes are measured (by the tracker).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from agoq.runtime.activations.activation_bytes import LayerShape, predict_layer_bytes
from agoq.runtime.activations.laaq import apply_activation_policy, remove_activation_policy
from agoq.runtime.activations.policy import as_policy
from agoq.runtime.activations.saved_bytes import track_saved_tensors
from agoq.models.llama import LlamaForCausalLM
from agoq.runtime.optim.adamw8bit import FusedAdamW8bit
from agoq.runtime.optim.state_bytes import state_table
from agoq.profiler.model_source import next_token_loss
from agoq.models.step_peak import HeadShape, head_peak_bytes



MEASURED_WITH = {"optimizer": "adamw8bit", "master": "fp32", "gradients": "bf16"}  # the measured step's


def static_bytes(model: nn.Module) -> dict:
    """Weights, float32 master weights, gradients (bf16 and 8-bit QuanGrad) and optimizer state, in bytes:
    the flat fields (masters and moments of the measured step, MEASURED_WITH) and `state` (agoq.runtime.optim.
    state_bytes.state_table: masters, moments and step transient of every optimizer/master combination,
    gradient bytes of every storage)."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    elem = params[0].element_size() if params else 2
    table = state_table([p.numel() for p in params], elem)
    measured = table["optimizers"]["adamw8bit/fp32"]
    return {
        "weights_bytes": weights,
        "master_bytes": measured["masters"],
        "gradients_bytes_bf16": table["gradients"]["bf16"],
        "gradients_bytes_quangrad8": table["gradients"]["quangrad8"],
        "optimizer_bytes_adamw": table["optimizers"]["adamw/fp32"]["moments"],
        "optimizer_bytes_adamw8bit": table["optimizers"]["adamw8bit/fp32"]["moments"],
        "state": table,
        "measured_with": dict(MEASURED_WITH),
    }


class _FusedStep:
    """The measured step's optimizer: `step(opt)` applies the parameters' .grad, `zero_grad()` drops them
    (the masters live in the optimizer's state)."""

    def __init__(self, params: list, optimizer: FusedAdamW8bit):
        self.params = params

    def step(self, optimizer: FusedAdamW8bit) -> None:
        optimizer.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def training_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The loss `agoq train` computes on `ids` [B, S + 1]: agoq's models through their chunked LM head,
    other models (Hugging Face) through their logits."""
    if isinstance(model, LlamaForCausalLM):
        return model(ids[:, :-1], ids[:, 1:])
    return next_token_loss(model, ids)


def predicted_activation_bytes(shape: LayerShape, num_layers: int, policy, outside_bytes: int) -> int:
    """Bytes kept for backward by the whole model under `policy`: every layer's prediction plus `outside_bytes`."""
    policy = as_policy(policy)
    total = outside_bytes
    for i in range(num_layers):
        settings = None if policy.keeps_everything(i) else policy.settings(i)
        total += sum(predict_layer_bytes(shape, settings, policy.block).values())
    return total


def measure_step(model: nn.Module, ids: torch.Tensor, policy) -> dict:
    """One real training step (fwd + bwd + the fused 8-bit AdamW with float32 masters, as `agoq train
    --optimizer adamw8bit`) under `policy`: measured peaks (GPU) of the fwd + bwd part and of the optimizer
    step, step seconds (and the optimizer step's alone), and the activation bytes the tracker counted (total
    and outside the decoder layers)."""
    device = ids.device
    cuda = device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    opt = FusedAdamW8bit(params, lr=0.0, masters=True)  # lr 0: the weights do not move between policies
    weights = _FusedStep(params, opt)
    apply_activation_policy(model, policy)
    peaks = [None, None]
    try:
        with track_saved_tensors(model) as log:
            loss = training_loss(model, ids)
        loss.backward()
        weights.step(opt)  # warm-up: allocates the optimizer state
        del loss
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        weights.zero_grad()
        loss = training_loss(model, ids)
        loss.backward()
        del loss
        if cuda:
            torch.cuda.synchronize(device)
            peaks[0] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        opt_start = time.perf_counter()
        weights.step(opt)
        if cuda:
            torch.cuda.synchronize(device)
            peaks[1] = torch.cuda.max_memory_allocated(device)
        end = time.perf_counter()
        seconds, opt_seconds = end - start, end - opt_start
    finally:
        remove_activation_policy(model)
        weights.zero_grad()
        del opt, weights
        if cuda:
            torch.cuda.empty_cache()
    return {"measured_peak_bytes": None if peaks[0] is None else max(peaks), "peak_forward_backward": peaks[0],
            "peak_optimizer_step": peaks[1], "step_seconds": seconds, "optimizer_step_seconds": opt_seconds,
            "measured_activation_bytes": log.total(), "outside_bytes": sum(log.outside.values())}


def memory_section(model: nn.Module, shape: LayerShape, num_layers: int, ids: torch.Tensor,
                   policies=("bf16", "agoq-paper"), failures: list | None = None) -> dict:
    """The profile.json "memory" section: static parts, calibrated fixed parts, and predicted vs
    measured peak for each policy (calibrated on the first).

    Two peaks are modelled: during fwd + bwd, static + activations + `fixed_bytes`, and during the
    optimizer step, static + `fixed_bytes_optimizer_step` (AdamW's temporaries, independent of the
    policy); the step's peak is the larger. For agoq's models the section also records the chunked LM
    head's shape and its forward peak (`chunked_lm_head`, agoq.models.step_peak.head_peak_parts) and
    `workspace_bytes` = fixed_bytes + outside_activation_bytes + gradients_bytes_bf16 - that peak: the
    calibrated step has no bf16 gradient yet at the loss's forward peak, so that `fixed_bytes` holds minus
    them, which a plan with other gradient storage (QuanGrad's buffer, allocated all run) must add back
    (agoq.models.step_peak.extra_bytes).
    """
    section = static_bytes(model)
    if isinstance(model, LlamaForCausalLM):  # its chunked head: where the eager step peaks (agoq.models.step_peak)
        cfg = model.config
        seq = ids.shape[1] - 1
        head = HeadShape(cfg.vocab_size, cfg.hidden_size, cfg.head_dim, seq, ids.shape[0] * seq,
                         model.lm_head.weight.element_size())
        section["chunked_lm_head"] = {**head.as_dict(), "peak_bytes": head_peak_bytes(head)}
    base = (section["weights_bytes"] + section["master_bytes"] + section["gradients_bytes_bf16"]
            + section["optimizer_bytes_adamw8bit"])  # the measured step's (MEASURED_WITH)
    steps, fixed, fixed_opt = [], None, None
    for name in policies:
        try:
            m = measure_step(model, ids, name)
        except Exception as e:  # noqa: BLE001 - an OOM on one policy is recorded, the profile goes on
            if failures is not None:
                failures.append({"what": f"memory step policy={name}", "error": f"{type(e).__name__}: {e}"[:500]})
            steps.append({"policy": name, "measured_peak_bytes": None, "predicted_peak_bytes": None,
                          "step_seconds": None})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        # what the embedding, final norm, head and loss keep does not depend on the policy: the first
        # step's count is used for every prediction
        section.setdefault("outside_activation_bytes", m["outside_bytes"])
        activations = predicted_activation_bytes(shape, num_layers, name, section["outside_activation_bytes"])
        if fixed is None and m["peak_forward_backward"] is not None:
            fixed = m["peak_forward_backward"] - base - activations
            fixed_opt = m["peak_optimizer_step"] - base
        predicted_fb = base + activations + (fixed or 0)
        predicted = max(predicted_fb, base + (fixed_opt or 0))
        step = {"policy": name, "measured_peak_bytes": m["measured_peak_bytes"], "predicted_peak_bytes": predicted,
                "step_seconds": m["step_seconds"], "optimizer_step_seconds": m["optimizer_step_seconds"],
                "predicted_activation_bytes": activations,
                "measured_activation_bytes": m["measured_activation_bytes"],
                "measured_peak_bytes_forward_backward": m["peak_forward_backward"],
                "predicted_peak_bytes_forward_backward": predicted_fb,
                "measured_peak_bytes_optimizer_step": m["peak_optimizer_step"]}
        if m["measured_peak_bytes"]:
            step["relative_error"] = (predicted - m["measured_peak_bytes"]) / m["measured_peak_bytes"]
        steps.append(step)
    section["fixed_bytes"] = fixed
    section["fixed_bytes_optimizer_step"] = fixed_opt
    if fixed is not None and "chunked_lm_head" in section and "outside_activation_bytes" in section:
        # what the step holds beyond its modelled tensors at the loss's forward peak (agoq.models.step_peak)
        section["workspace_bytes"] = (fixed + section["outside_activation_bytes"] + section["gradients_bytes_bf16"]
                                      - section["chunked_lm_head"]["peak_bytes"])
    section["steps"] = steps
    if fixed is None:
        section["notes"] = ["peak memory not measured on this device (no allocator statistics on the CPU): "
                            "measured_peak_bytes and fixed_bytes are null; predicted_peak_bytes leaves fixed out"]
    else:
        section["notes"] = [f"fixed_bytes calibrated on the {policies[0]} step; the other steps are predictions"]
    return section
