"""Whether a model can train on this device at all, decided from its config before anything is built.

The floor of what one training step holds on one process, in bytes (P parameters, counted from the config by
`LlamaConfig.num_parameters`, never by building the model; e bytes per value of the model's dtype; L decoder
layers of hidden size C; one sequence of S tokens):

  weights       e * P
  gradients     g * P           g = e (gradients in the parameters' dtype), 1 for an 8-bit gradient buffer
  optimizer     (m + k) * P     m = 4 for float32 master weights (0 without masters or for float32 weights);
                                k = 8 for AdamW's two float32 moments, 2 for 8-bit moments
  activations   e * S * C * (L + 1)   the input of every decoder layer and the embeddings' output: what even
                                a step that recomputes every layer keeps for one micro-batch of one sequence

Weights, gradients and optimizer state shared over W processes (sharded, fsdp, pipeline) count 1/W on each:
a floor for every parallel mode. Scale factors, workspace and the rest of a step's activations only add to
it, so a model refused here cannot run; one that passes may still need more (the profile's memory model and
the search say how much). Available memory: on a GPU the free bytes torch.cuda.mem_get_info reports; on the
CPU MemAvailable in /proc/meminfo (else the free pages os.sysconf reports), bounded by the cgroup's limit
where one is set, shared by the processes of this host. Arithmetic on integers: a config of 100,000 layers
or a hidden size of 10^7 is refused at once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from agoq.models.config import LlamaConfig

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def gb(n: float) -> str:
    """Bytes in decimal gigabytes, as the refusal writes them: '16.1 GB' (small ones with more decimals)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e9:.3f} GB"


@dataclass(frozen=True)
class StepFloor:
    """The bytes one process holds at least during a training step (see the module's docstring)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def parts(self) -> str:
        return (f"weights {gb(self.weights)}, gradients {gb(self.gradients)}, optimizer state {gb(self.optimizer)}, "
                f"activations of one sequence {gb(self.activations)}")


def step_floor(config: LlamaConfig, *, dtype: str, seq_len: int, optimizer: str = "adamw8bit",
               master: str = "none", gradient_bytes: float | None = None, share: int = 1) -> StepFloor:
    """The floor of a training step of `config` (module docstring): `optimizer` adamw (float32 moments) or
    adamw8bit, `master` fp32 or none, `gradient_bytes` per parameter (None: the dtype's), the state shared by
    `share` processes."""
    e = ELEM_BYTES[dtype]
    params = config.num_parameters()
    masters = 4 if master == "fp32" and dtype != "fp32" else 0
    moments = 8 if optimizer == "adamw" else 2
    grads = e if gradient_bytes is None else gradient_bytes
    acts = e * seq_len * config.hidden_size * (config.num_hidden_layers + 1)
    return StepFloor(weights=-(-e * params // share), gradients=int(-(-grads * params // share)),
                     optimizer=-(-(masters + moments) * params // share), activations=acts)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """Bytes the cgroup (v2) still allows this process, None without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def available_bytes(device: str) -> tuple[int | None, str]:
    """(free bytes, what they are) of `device` ("cpu", "cuda", "cuda:N"); None where it cannot be read."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(index)
        return int(free), f"free on GPU {index} ({torch.cuda.get_device_name(index)})"
    known = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    return (min(known) if known else None), "RAM available on this machine"


def layers_that_fit(config: LlamaConfig, available: int, **floor_args) -> int:
    """The most decoder layers of `config` whose step floor fits `available` bytes (0: not even one)."""
    import dataclasses

    one = step_floor(dataclasses.replace(config, num_hidden_layers=1), **floor_args).total
    two = step_floor(dataclasses.replace(config, num_hidden_layers=2), **floor_args).total
    per_layer = two - one
    return max(0, (available - (one - per_layer)) // per_layer) if per_layer > 0 else 0


def check_fits(config: LlamaConfig, *, device: str, dtype: str, seq_len: int, what: str, fewer_layers: str,
               seq_len_from: str = "--seq-len", processes_here: int = 1, available: int | None = None,
               **floor_args) -> StepFloor:
    """Refuse (ValueError) a model whose step floor (`step_floor`) exceeds the memory of `device` (its free bytes,
    shared by `processes_here` processes of this host on the CPU; `available` given: those bytes), saying both in
    GB and what to change: `fewer_layers` says how to train fewer layers (the command's flag), `seq_len_from` where
    the sequence length came from. Returns the floor."""
    floor = step_floor(config, dtype=dtype, seq_len=seq_len, **floor_args)
    where = "given"
    if available is None:
        available, where = available_bytes(device)
        if available is None:
            return floor
        if not device.startswith("cuda") and processes_here > 1:
            available //= processes_here
            where += f", shared by {processes_here} processes"
    if floor.total <= available:
        return floor
    fit = layers_that_fit(config, available, dtype=dtype, seq_len=seq_len, **floor_args)
    layers = (f"{fewer_layers} (at most {fit} of its {config.num_hidden_layers} layers fit)" if fit
              else f"{fewer_layers} (not even one layer fits at this sequence length)")
    raise ValueError(
        f"{what} ({config.num_parameters():,} parameters, {config.num_hidden_layers} layers, hidden size "
        f"{config.hidden_size}, {dtype}) needs at least {gb(floor.total)} on {device} for one training step of one "
        f"{seq_len}-token sequence ({floor.parts()}), but {gb(available)} is {where}: use {layers}, a shorter "
        f"{seq_len_from} (the figure is for a micro-batch of one sequence already), or a device with more memory")


def check_spec_fits(spec: str, layers: int | None, *, device: str, dtype: str, seq_len: int, fewer_layers: str,
                    **floor_args) -> None:
    """`check_fits` for a model named as the commands take it (a preset or a config.json; `layers`: only the first N
    of its layers) before it is built. A config that does not parse, or a package.module:function model, is left
    to the command to report or build (only building it would tell its size)."""
    from agoq.models import PRESETS, resolve_config

    if spec not in PRESETS and not (spec.endswith(".json") or os.path.isfile(spec)):
        return
    try:
        config = resolve_config(spec)
    except (ValueError, NotImplementedError, OSError):
        return
    if layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=layers)
    check_fits(config, device=device, dtype=dtype, seq_len=seq_len, what=f"model {spec}", fewer_layers=fewer_layers,
               **floor_args)


__all__ = ["StepFloor", "step_floor", "available_bytes", "layers_that_fit", "check_fits", "check_spec_fits", "ELEM_BYTES", "gb"]
