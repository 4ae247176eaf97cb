"""Where a run computes and in what dtype, and whether a plan's memory fits that device.

The device is --device's (default: the GPU of this rank when CUDA is visible, else the CPU); the dtype is
--dtype's (default: bf16 on a GPU, fp32 on the CPU). A plan whose predicted peak (else its budget) exceeds the
GPU's memory is refused before anything is built on it.
"""

from __future__ import annotations

import torch

from agoq.train.config import ModelConfig
from agoq.train.parallel import World

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def run_device(model_cfg: ModelConfig, world: World) -> torch.device:
    """The device of this rank: --device's (cuda: this rank's local GPU unless it names one), else CUDA when
    visible, else the CPU."""
    name = model_cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
        return torch.device("cuda", world.local_rank if ":" not in name else int(name.split(":")[1]))
    return torch.device("cpu")  # ModelConfig refused every other name


def run_dtype(model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The parameters' and activations' dtype: --dtype's, else bf16 on a GPU and fp32 on the CPU."""
    return DTYPES[model_cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")]


def check_budget(plan, layer_stage: list[int] | None, world: World, device: torch.device, where: str) -> None:
    """Refuse a plan whose predicted peak (this rank's stage's, else the largest; else its budget) exceeds this
    GPU's memory."""
    total = torch.cuda.get_device_properties(device).total_memory
    peaks = plan.predicted.peak_bytes_per_stage
    stage = world.rank if layer_stage is not None and len(peaks) > 1 else None
    if peaks:
        need = peaks[stage] if stage is not None and stage < len(peaks) else max(peaks)
        what = "predicted peak"
    elif plan.budget_bytes:
        need, what = plan.budget_bytes, "memory budget"
    else:
        return
    if need > total:
        from agoq.units import format_bytes

        raise ValueError(f"{where}: the plan's {what} is {format_bytes(need)} but this GPU "
                         f"({torch.cuda.get_device_name(device)}) has {format_bytes(total)}: search a plan with "
                         f"--budget below {format_bytes(total)} for this device")


__all__ = ["run_device", "run_dtype", "check_budget", "DTYPES"]
