"""SDP4Bit's sharded AdamW (arXiv 2410.15526): each rank keeps and steps its shard of the flat parameters;
gradients arrive by TLq-HS reduce-scatter and weights leave by qWD all-gather (agoq.runtime.comm.sdp4bit, whose
shard layout this follows).

A rank's state is its shard of the flat float32 master weights and the shard's two Adam moments in 8 bits
(AdamW8bit's format: float8 e4m3 codes and one float32 scale per block, the second moment stored as its
square root), stepped by the fused 8-bit AdamW step (`agoq.runtime.optim.fused_adamw.adamw8bit_step`: one Triton
launch per bucket on the GPU, its chunked torch reference elsewhere). The moment block is the shard
layout's 128-value group, so every shard starts on a block boundary: the moments of the whole flat vector
are the concatenation of the ranks' (`global_layout`), whatever the world size, which lets a checkpoint
written by N ranks load into M.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from agoq.runtime.comm.sdp4bit import (
    GRAD_GROUP,
    derive_seed,
    exact_all_gather,
    exact_reduce_scatter,
    qwd_all_gather,
    shard_bounds,
    tlq_hs,
    topology,
)
from agoq.runtime.optim.fused_adamw import adamw8bit_step, quantize_blocks

MOMENT_BLOCK = GRAD_GROUP  # values per moment scale: shards start on whole blocks (see the module docstring)
MOMENTS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sqrt_codes", "exp_avg_sqrt_scales")


class _NonFinite(Exception):
    def __init__(self, ranks: list[int]):
        super().__init__(f"non-finite gradient on rank(s) {ranks}")
        self.ranks = ranks


class SDP4BitOptimizer(torch.optim.Optimizer):
    """Sharded AdamW (ZeRO-style) with SDP4Bit's quantized collectives.

    The parameters (identical on every rank, one parameter group) are seen as one flat vector; rank r
    keeps the fp32 master weights and the 8-bit Adam moments of its `shard_bounds` slice only. `step()`:
    flatten the gradients (a parameter without .grad counts as zero), reduce-scatter them (TLq-HS if
    quantize_gradients, else exact fp32) and divide by the world size, the fused 8-bit AdamW step on
    the owned shard (decoupled weight decay, bias-corrected moments, as torch.optim.AdamW, with the
    moments requantized per 128-value block), then all-gather the weights (qWD if quantize_weights,
    else the exact fp32 shard values) into every parameter, in its dtype. With both flags off the
    communication is exact (the update is that of `adamw8bit_step` on the averaged gradient); with
    one rank nothing is communicated or quantized but the moments.

    Non-finite gradients: one flag per rank is all-reduced before anything else, so every rank sees
    the same verdict. on_nonfinite="skip" (default, as AMP's GradScaler): nothing changes, step()
    returns False and `skipped_steps` counts it; "raise": FloatingPointError naming the ranks.
    step() returns True when the update was applied. The constructor is collective (it checks that
    the parameters agree across ranks and may create node sub-groups): call it on every rank.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        group=None,
        node_size: int | None = None,
        intra_group=None,
        inter_group=None,
        quantize_gradients: bool = True,
        quantize_weights: bool = True,
        hadamard: bool = True,
        seed: int | None = None,
        on_nonfinite: str = "skip",
        lanes: int = 1,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("SDP4BitOptimizer got an empty parameter list")
        if any(isinstance(p, dict) for p in params):
            raise ValueError("SDP4BitOptimizer takes one flat list of parameters, not parameter groups")
        if not all(isinstance(p, torch.Tensor) and p.is_floating_point() for p in params):
            raise TypeError("every parameter must be a floating-point torch.Tensor")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears more than once in the list")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.group = group
        self.topo = topology(group, intra_group=intra_group, inter_group=inter_group, node_size=node_size)
        self.quantize_gradients, self.quantize_weights, self.hadamard = quantize_gradients, quantize_weights, hadamard
        self.on_nonfinite = on_nonfinite
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be a positive integer, got {lanes!r}")
        self.lanes = lanes
        self.seed = derive_seed(seed)
        self.skipped_steps = 0
        self._params = params
        flat = self._flat_params()
        self.numel = flat.numel()
        self.shard = shard_bounds(self.numel, self.topo.world)[self.topo.rank]
        self._check_same_everywhere(flat)
        self.master = flat[self.shard[0]: self.shard[1]].clone()
        zeros = torch.zeros(self.master.numel(), dtype=torch.float32, device=self.master.device)
        self.moments = {}  # AdamW8bit's per-parameter state format, for the shard as one parameter
        self.moments["exp_avg_codes"], self.moments["exp_avg_scales"] = quantize_blocks(zeros, MOMENT_BLOCK)
        self.moments["exp_avg_sqrt_codes"], self.moments["exp_avg_sqrt_scales"] = quantize_blocks(zeros, MOMENT_BLOCK)
        del zeros
        self.steps = 0

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "numel"):
            raise NotImplementedError("SDP4BitOptimizer's flat layout is fixed when it is built")
        super().add_param_group(param_group)

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self._params])

    def _flat_grads(self, grads: list[torch.Tensor] | None = None) -> torch.Tensor:
        grads = [p.grad for p in self._params] if grads is None else list(grads)
        if len(grads) != len(self._params):
            raise ValueError(f"{len(grads)} gradients for {len(self._params)} parameters")
        return torch.cat([g.detach().reshape(-1).float() if g is not None
                          else p.new_zeros(p.numel(), dtype=torch.float32) for p, g in zip(self._params, grads)])

    def _check_same_everywhere(self, flat: torch.Tensor) -> None:
        if self.topo.world == 1:
            return
        x = torch.nan_to_num(flat.double(), nan=1.0, posinf=2.0, neginf=3.0)
        idx = torch.arange(x.numel(), device=x.device, dtype=torch.float64)
        hi = torch.stack([x.sum(), (x * idx.remainder(7919)).sum(), torch.tensor(float(x.numel()), device=x.device,
                                                                                  dtype=torch.float64)])
        lo = -hi
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(lo, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(hi, -lo):
            raise ValueError("the parameters differ across ranks (values or sizes): every rank must start from "
                             "the same model (same seed or a broadcast from rank 0)")

    def _nonfinite_ranks(self, flat_grad: torch.Tensor) -> list[int]:
        flags = torch.zeros(self.topo.world, dtype=torch.int32, device=flat_grad.device)
        flags[self.topo.rank] = int(not bool(torch.isfinite(flat_grad).all()))
        if self.topo.world > 1:
            dist.all_reduce(flags, group=self.group)
        return flags.nonzero().flatten().tolist()

    @torch.no_grad()
    def step(self) -> bool:  # type: ignore[override]
        """One sharded AdamW step from the parameters' .grad; False if skipped for non-finite gradients."""
        try:
            shard = self.reduce_gradients()
        except _NonFinite as e:
            if self.on_nonfinite == "raise":
                raise FloatingPointError(f"non-finite gradient (inf or NaN) on rank(s) {e.ranks}: step not taken")
            self.skipped_steps += 1
            return False
        self.apply_reduced(shard)
        return True

    @torch.no_grad()
    def reduce_gradients(self, grads: list[torch.Tensor] | None = None, *, check_finite: bool = True) -> torch.Tensor:
        """This rank's shard (`shard_bounds`, float32) of the gradient averaged over the ranks: the flat
        gradients (`grads`, one per parameter in order, else the parameters' .grad; None counts as zero)
        reduce-scattered (TLq-HS if quantize_gradients, else exactly) and divided by the world size.

        The squares of every rank's shard add up to the squared norm of the averaged gradient as reduced
        (what a clip norm must read). `check_finite`: first agree across ranks on non-finite gradients and
        raise FloatingPointError on every rank (else they propagate into the shard). Collective; pair it
        with `apply_reduced`.
        """
        grad = self._flat_grads(grads)
        if check_finite:
            bad = self._nonfinite_ranks(grad)
            if bad:
                raise _NonFinite(bad)
        world = self.topo.world
        if world == 1:
            shard = grad
        elif self.quantize_gradients:
            seed = derive_seed(self.seed, self.steps + 1)
            shard = tlq_hs(grad, self.topo, self.hadamard, derive_seed(seed, 1), self.lanes)
        else:
            shard = exact_reduce_scatter(grad, self.group)
        return shard.div_(world)

    @torch.no_grad()
    def apply_reduced(self, shard: torch.Tensor, scale: float = 1.0) -> None:
        """AdamW on this rank's shard with `shard` x `scale` as its gradient (`reduce_gradients`' result and
        the clip factor), then the weights all-gathered (qWD or exactly) into every parameter. Collective."""
        self.steps += 1
        seed = derive_seed(self.seed, self.steps)
        self._adamw(shard, scale)
        world = self.topo.world
        if world == 1:
            full = self.master
        elif self.quantize_weights:
            full = qwd_all_gather(self.master, self._flat_params(), self.group, seed=derive_seed(seed, 2),
                                  lanes=self.lanes)
        else:
            full = exact_all_gather(self.master, self.numel, self.group)
        offset = 0
        for p in self._params:
            p.copy_(full[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    def _adamw(self, grad: torch.Tensor, clip: float = 1.0) -> None:
        """The fused 8-bit AdamW step on this rank's shard (`grad`: its averaged float32 gradient, times `clip` in
        the kernel: no scaled copy), in place."""
        if self.master.numel() == 0:  # a small model leaves the last ranks no shard
            return
        hp = self.param_groups[0]
        adamw8bit_step([self.master], None, [grad], [self.moments], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                       weight_decay=hp["weight_decay"], step=self.steps, clip=clip, block=MOMENT_BLOCK)

    def global_layout(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """This rank's state tensors as pieces of whole-vector logical tensors: {name: (tensor, offset, length of
        the logical tensor)}, offsets and lengths in elements. "master" is a slice of the flat parameters
        (`numel` values); the codes slices of the moments' codes (`numel` rounded up to whole 128-blocks, zero
        padding) and the scales slices of their one-per-block scales. The pieces of all ranks tile each
        logical tensor exactly; the logical tensors do not depend on the world size."""
        start, end = self.shard
        blocks = -(-self.numel // MOMENT_BLOCK)
        pieces = {"master": (self.master, start, self.numel)}
        for name, t in self.moments.items():
            if name.endswith("_codes"):
                pieces[name] = (t, start, blocks * MOMENT_BLOCK)
            else:
                pieces[name] = (t, start // MOMENT_BLOCK, blocks)
        return pieces

    def scalar_state(self) -> dict:
        """The state every rank holds alike: hyperparameters, step counts, seed, and the flat size it is for."""
        hp = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"hyperparameters": hp, "steps": self.steps, "skipped_steps": self.skipped_steps, "seed": self.seed,
                "numel": self.numel, "moment_block": MOMENT_BLOCK}

    def load_scalar_state(self, state: dict) -> None:
        """Restore `scalar_state()` (the tensors of `global_layout` are restored in place by whoever loads them)."""
        if state.get("numel") != self.numel or state.get("moment_block") != MOMENT_BLOCK:
            raise ValueError(f"optimizer state for {state.get('numel')} values in blocks of "
                             f"{state.get('moment_block')} cannot be loaded into one for {self.numel} values in "
                             f"blocks of {MOMENT_BLOCK}: the parameters differ")
        self.param_groups[0].update(state["hyperparameters"])
        self.steps, self.skipped_steps, self.seed = state["steps"], state["skipped_steps"], state["seed"]

    def state_dict(self) -> dict:
        """This rank's state: `scalar_state()`, the world layout, and copies of its shard's master weights and
        8-bit moments (codes and scales as stored)."""
        return {**self.scalar_state(), "layout": {"numel": self.numel, "world": self.topo.world,
                                                  "rank": self.topo.rank},
                **{name: t.clone() for name, (t, _, _) in self.global_layout().items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict` saved on this same rank, with the same parameters and world size."""
        mine = {"numel": self.numel, "world": self.topo.world, "rank": self.topo.rank}
        if state_dict.get("layout") != mine:
            raise ValueError(f"state saved for layout {state_dict.get('layout')} cannot be loaded into {mine}")
        self.load_scalar_state(state_dict)
        for name, (t, _, _) in self.global_layout().items():
            t.copy_(state_dict[name])
