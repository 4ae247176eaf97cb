"""The trainer's optimizer steps: torch's AdamW on float32 masters, agoq's fused 8-bit AdamW (also on FSDP2's
local shards).

Each is an `OptimizerStep`: `.optimizer`, `.masters` (float32 copies kept beside the optimizer, or None),
`.fused` (whether `step` reads the gradients as stored, QuanGrad's codes included), `step(grads, scale)`,
which applies the gradients multiplied by the clip factor `scale`, and the checkpoint's view of the module and
the optimizer: `checkpoint_state(module)` gives a torch.distributed.checkpoint state dict {"model": ...,
"optimizer": ...} keyed by parameter names (the optimizer state as stored: 8-bit codes and scales, not
dequantized), which DCP fills in place on load, and `restore(module, state)` puts a loaded one to work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from agoq.runtime.optim.master_weights import MasterWeights
from agoq.train.config import OptimizerConfig

BETAS = (0.9, 0.95)
EPS = 1e-8


class OptimizerStep:
    """An optimizer and how the loop hands it one step's gradients."""

    fused = False
    reshardable = True  # its checkpoint loads at another world size
    optimizer: torch.optim.Optimizer
    masters: list[torch.Tensor] | None = None

    def zero_grad(self) -> None:
        """Drop the gradients the optimizer keeps beside the parameters' (none by default)."""

    def step(self, grads, scale: float) -> None:
        raise NotImplementedError

    def checkpoint_state(self, module: nn.Module) -> dict:
        """{"model", "optimizer"} state dicts by parameter name (DCP's get_state_dict: plain tensors, or DTensors
        for sharded parameters). An optimizer that has not stepped yet gets its state made first (DCP takes a
        step of learning rate 0 on zero gradients), so that a load has tensors to fill."""
        model, optimizer = get_state_dict(module, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def restore(self, module: nn.Module, state: dict) -> None:
        """Load a `checkpoint_state` that DCP has filled into the module and the optimizer."""
        set_state_dict(module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _rank_key() -> str:
    """This process's key for state only it holds: rank<r> (rank0 without a process group)."""
    return f"rank{dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}"


def _names(module: nn.Module) -> list[str]:
    """Names of the trained parameters, in `module.parameters()` order (the optimizers' order)."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


class AdamWWithMasters(OptimizerStep):
    """torch's AdamW on float32 masters of non-float32 parameters, rounded back after each step."""

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig, device: torch.device):
        self.weights = MasterWeights(params)
        self.masters = self.weights.masters
        # torch's fused kernel on the GPU (one launch for all parameters), its default elsewhere
        self.optimizer = torch.optim.AdamW(self.weights.targets, lr=optim.lr, betas=BETAS, eps=EPS,
                                           weight_decay=optim.weight_decay, fused=device.type == "cuda" or None)

    def zero_grad(self) -> None:
        if self.masters is not None:
            self.weights.zero_grad()

    def step(self, grads, scale: float) -> None:
        self.weights.step(self.optimizer, grads, scale)

    def checkpoint_state(self, module: nn.Module) -> dict:
        """As OptimizerStep's; with masters (torch's AdamW steps them, not the module's parameters) the optimizer
        state is keyed by the names of the parameters the masters copy, and the masters are saved beside it."""
        if self.masters is None:
            return super().checkpoint_state(module)
        names = _names(module)
        if not self.optimizer.state:  # nothing to load into yet: the state of a step of learning rate 0
            self._make_state()
        saved = self.optimizer.state_dict()
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]
        return {"model": get_model_state_dict(module),
                "optimizer": {"state": {names[i]: st for i, st in saved["state"].items()}, "param_groups": groups,
                              "masters": dict(zip(names, self.masters))}}

    def _make_state(self) -> None:
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.weights.set_grads([torch.zeros_like(m) for m in self.masters])
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.weights.zero_grad()

    def restore(self, module: nn.Module, state: dict) -> None:
        if self.masters is None:
            return super().restore(module, state)
        index = {name: i for i, name in enumerate(_names(module))}
        set_model_state_dict(module, state["model"])
        optimizer = state["optimizer"]
        self.optimizer.load_state_dict({
            "state": {index[name]: st for name, st in optimizer["state"].items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]}
                             for g in optimizer["param_groups"]]})
        for name, master in optimizer["masters"].items():
            if master is not self.masters[index[name]]:
                self.masters[index[name]].data.copy_(master)


class FusedAdamW8bitStep(OptimizerStep):
    """One fused pass per bucket: gradients read where they live (QuanGrad's codes or .grad), the clip factor
    multiplied in, float32 masters (--master fp32) kept in the optimizer's state."""

    fused = True

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig, seed: int):
        from agoq.runtime.optim.adamw8bit import FusedAdamW8bit

        self.optimizer = FusedAdamW8bit(params, lr=optim.lr, betas=BETAS, eps=EPS, weight_decay=optim.weight_decay,
                                        masters=optim.master == "fp32", seed=seed)

    def step(self, grads, scale: float) -> None:
        self.optimizer.step(grads=grads, clip_scale=scale)


class FSDPAdamW8bitStep(FusedAdamW8bitStep):
    """agoq's fused 8-bit AdamW on each rank's local shards of FSDP2's parameters (plain tensors that share
    the DTensors' storage; with --weight-gather int8/int4 the plain tensors inside agoq's gather wrappers): the
    moments are block-quantized per shard; float32 shards are their own masters."""

    reshardable = False

    def __init__(self, params: list[torch.Tensor], optim: OptimizerConfig, seed: int):
        from agoq.runtime.comm.fsdp_weight_gather import unwrap
        from agoq.runtime.optim.adamw8bit import FusedAdamW8bit

        self.optimizer = FusedAdamW8bit([unwrap(p).detach() for p in params], lr=optim.lr, betas=BETAS, eps=EPS,
                                        weight_decay=optim.weight_decay, masters=optim.master == "fp32", seed=seed)

    def step(self, grads, scale: float) -> None:
        self.optimizer.step(grads=[g.to_local() for g in grads], clip_scale=scale)

    def checkpoint_state(self, module: nn.Module) -> dict:
        """The model's sharded parameters (DTensors) by name, and this rank's optimizer state under its own key
        (`rank<r>`): the 8-bit moments are block-quantized per local shard, so they reload at the same world size
        only. A state not made yet is made first (zero moments), so that a load has tensors to fill."""
        opt = self.optimizer
        for p in (p for g in opt.param_groups for p in g["params"]):
            if not opt.state[p]:
                opt._init_state(p)
        saved = opt.state_dict()
        mine = {"state": {str(i): st for i, st in saved["state"].items()}, "param_groups": saved["param_groups"]}
        return {"model": get_model_state_dict(module), "optimizer": {_rank_key(): mine}}

    def restore(self, module: nn.Module, state: dict) -> None:
        set_model_state_dict(module, state["model"])
        mine = state["optimizer"][_rank_key()]
        self.optimizer.load_state_dict({"state": {int(i): st for i, st in mine["state"].items()},
                                        "param_groups": mine["param_groups"]})


def build_optimizer(params: list[torch.Tensor], optim: OptimizerConfig, *, seed: int,
                    device: torch.device) -> OptimizerStep:
    """The optimizer of one process, DDP or a pipeline stage: 8-bit fused AdamW, or AdamW on masters."""
    if optim.optimizer == "adamw8bit":
        return FusedAdamW8bitStep(params, optim, seed)
    return AdamWWithMasters(params, optim, device)


def build_fsdp_optimizer(params: list[torch.Tensor], optim: OptimizerConfig, *, seed: int,
                         device: torch.device) -> OptimizerStep:
    """The optimizer of `--parallel fsdp` over FSDP2's sharded parameters (DTensors): torch's AdamW on them,
    or agoq's fused 8-bit AdamW on their local shards."""
    if optim.optimizer == "adamw8bit":
        return FSDPAdamW8bitStep(params, optim, seed)
    return AdamWWithMasters(params, optim, device)


__all__ = ["OptimizerStep", "build_optimizer", "build_fsdp_optimizer", "BETAS", "EPS"]
