"""What a training step keeps besides activations, in bytes, counted the way agoq's trainer allocates it.

For parameters of n_i values (model dtype of e bytes per value; b = the 8-bit blocks' size, 256 by default;
blocks(n) = ceil(n / b)):

  weights                 sum e * n_i
  gradients  bf16         sum e * n_i                       (.grad in the parameters' dtype)
             quangrad8    sum blocks(n_i) * (b + 4)         (QuantizedGradients: each parameter's slice padded to
                                                             whole blocks of uint8 codes, a float32 scale per block)
  masters    fp32         sum 4 * n_i over non-float32 parameters (none: 0)
  moments    adamw        torch.optim.AdamW over the masters: sum 2 * 4 * n_i (exp_avg, exp_avg_sq, float32)
             adamw8bit    FusedAdamW8bit: per parameter of n_i >= min_8bit_numel (4096) values, two moments of
                          blocks(n_i) * b uint8 codes + blocks(n_i) float32 scales; smaller ones two float32 moments
                          (2 * 4 * n_i)
  step transient          what exists only during the optimizer step:
             adamw        the float32 gradients MasterWeights.set_grads hands torch's AdamW: sum 4 * n_i
                          (bf16 gradients read as they are by torch when there are no masters: 0)
             adamw8bit    the fused kernel reads gradients and state in place; its launch tables are a few
                          hundred bytes per bucket: counted as 0 (the CPU reference's float32 walk is bounded
                          by CHUNK values, at most 16 * CHUNK bytes: `reference_transient_bytes`)

`state_bytes(numels, ...)` returns each part; `agoq.profiler.memory` writes them into the profile for every
optimizer, master and gradient mode, and `agoq.search` adds them up.
"""

from __future__ import annotations

from typing import Iterable

from agoq.vocabulary import MASTERS, OPTIMIZERS, REPLICA_GRADIENT_MODES

GRADIENTS = REPLICA_GRADIENT_MODES  # a replica's whole gradients (sdp4bit's are sharded: agoq.search.state)
BLOCK = 256          # values per scale of the 8-bit moments (AdamW8bit's default)
GRAD_BLOCK = 256     # values per scale of QuanGrad's buffer
MIN_8BIT_NUMEL = 4096  # AdamW8bit: smaller parameters keep float32 moments
SCALE_BYTES = 4


def _blocks(n: int, block: int) -> int:
    return -(-int(n) // block)


def gradient_bytes(numels: Iterable[int], mode: str, elem_bytes: int = 2, grad_block: int = GRAD_BLOCK) -> int:
    """Bytes of one step's stored gradients: bf16 (the parameters' dtype) or QuanGrad's padded codes + scales."""
    numels = list(numels)
    if mode == "bf16":
        return elem_bytes * sum(numels)
    if mode == "quangrad8":
        return sum(_blocks(n, grad_block) * (grad_block + SCALE_BYTES) for n in numels)
    raise ValueError(f"gradient storage must be one of {', '.join(GRADIENTS)}, got {mode!r}")


def moment_bytes(numels: Iterable[int], optimizer: str, block: int = BLOCK, min_8bit_numel: int = MIN_8BIT_NUMEL) -> int:
    """Bytes of the optimizer's two moments (see the module docstring)."""
    numels = list(numels)
    if optimizer == "adamw":
        return 8 * sum(numels)
    if optimizer == "adamw8bit":
        return sum(2 * (_blocks(n, block) * (block + SCALE_BYTES)) if n >= min_8bit_numel else 8 * n for n in numels)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")


def master_bytes(numels: Iterable[int], master: str, elem_bytes: int = 2) -> int:
    """Bytes of float32 masters: 4 per value of non-float32 parameters with `master` fp32, else 0."""
    if master not in MASTERS:
        raise ValueError(f"master must be one of {', '.join(MASTERS)}, got {master!r}")
    return 4 * sum(numels) if master == "fp32" and elem_bytes != 4 else 0


def step_transient_bytes(numels: Iterable[int], optimizer: str, master: str, elem_bytes: int = 2) -> int:
    """Bytes that exist only during the optimizer step, beyond the state (see the module docstring)."""
    numels = list(numels)
    if optimizer == "adamw":
        return 4 * sum(numels) if master == "fp32" and elem_bytes != 4 else 0
    if optimizer == "adamw8bit":
        return 0
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")


def check_combination(optimizer: str, master: str) -> None:
    """Raise ValueError for a combination the trainer refuses (masters none needs the fused 8-bit step)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if master not in MASTERS:
        raise ValueError(f"master must be one of {', '.join(MASTERS)}, got {master!r}")
    if master == "none" and optimizer != "adamw8bit":
        raise ValueError("masters 'none' (bf16 parameters updated with stochastic rounding) needs the adamw8bit "
                         "optimizer")


def state_bytes(numels: Iterable[int], *, optimizer: str, master: str, gradients: str, elem_bytes: int = 2,
                block: int = BLOCK, grad_block: int = GRAD_BLOCK, min_8bit_numel: int = MIN_8BIT_NUMEL) -> dict:
    """Every part of a step's non-activation memory for parameters of `numels` values, in bytes:
    weights, gradients, masters, moments, step_transient, and `total` (all but the transient)."""
    check_combination(optimizer, master)
    numels = [int(n) for n in numels]
    out = {"weights": elem_bytes * sum(numels),
           "gradients": gradient_bytes(numels, gradients, elem_bytes, grad_block),
           "masters": master_bytes(numels, master, elem_bytes),
           "moments": moment_bytes(numels, optimizer, block, min_8bit_numel),
           "step_transient": step_transient_bytes(numels, optimizer, master, elem_bytes)}
    out["total"] = out["weights"] + out["gradients"] + out["masters"] + out["moments"]
    return out


def state_table(numels: Iterable[int], elem_bytes: int = 2) -> dict:
    """{"OPTIMIZER/MASTER": {"masters", "moments", "step_transient"}} for every combination the trainer runs,
    and {"gradients": {"bf16", "quangrad8"}}: the profile's record of the same counts."""
    numels = [int(n) for n in numels]
    table = {}
    for opt in OPTIMIZERS:
        for master in MASTERS:
            try:
                check_combination(opt, master)
            except ValueError:
                continue
            table[f"{opt}/{master}"] = {"masters": master_bytes(numels, master, elem_bytes),
                                        "moments": moment_bytes(numels, opt),
                                        "step_transient": step_transient_bytes(numels, opt, master, elem_bytes)}
    return {"optimizers": table, "gradients": {g: gradient_bytes(numels, g, elem_bytes) for g in GRADIENTS}}


def step_bytes_moved(optimizer: str, master: str, gradients: str, elem_bytes: int = 2) -> float:
    """Bytes one optimizer step reads and writes per parameter value (the 8-bit formats' scales left out):
    the step is memory-bound, so its time scales with these. Per value:

      adamw (masters)   gradient read e, float32 copy written 4 and read 4, master read + written 8, two float32
                        moments read + written 16, parameter written e
      adamw8bit         gradient read (e, or 1 for QuanGrad's codes), two 8-bit moments read + written 4, then
                        with masters: master read + written 8 and the parameter written e;
                        without: the parameter read + written 2e
    """
    check_combination(optimizer, master)
    grad = 1.0 if gradients == "quangrad8" else float(elem_bytes)
    if optimizer == "adamw":
        return grad + 8 + 8 + 16 + elem_bytes
    return grad + 4 + (8 + elem_bytes if master == "fp32" else 2 * elem_bytes)


__all__ = ["OPTIMIZERS", "MASTERS", "GRADIENTS", "state_bytes", "state_table", "gradient_bytes", "moment_bytes",
           "master_bytes", "step_transient_bytes", "check_combination", "step_bytes_moved"]
