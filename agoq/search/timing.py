"""What a training step costs in seconds, read from the steps the profile measured (agoq.formats.measured_steps):
every knob combination a plan may use is priced from measured steps of that kind, and a combination without one
is not offered.

For a compile mode c and a batch split (micro-batch m, accumulation a), the anchors are the measured steps at
(c, m, a) with bf16 gradients and the profile's base optimizer (the one its bf16 step at the profiled micro-batch
ran with): bf16 (every layer unmodified), agoq-paper (every layer under LAAQ's functions) and checkpoint-all. Then

    T(plan) = T_bf16(c, m, a, gradients, optimizer, masters)
              + (layers under LAAQ) x dQ + (checkpointed layers) x dC
    dQ = (T_paper - T_bf16) / L      (a layer's options have no seconds of their own, agoq.search.costs)
    dC = (T_checkpoint-all - T_bf16) / L

all at (c, m, a). T_bf16 at other knobs is the measured step of those knobs where there is one, else the anchor
plus what the knob was measured to add: another optimizer or masters (the bf16 steps of both at the profiled
micro-batch, their difference), QuanGrad's gradients (bf16 steps with quangrad8 and with bf16 gradients at the same
split). Another accumulation a' of a micro-batch measured at two accumulations is the line through them (each
further micro-batch costs what the measured ones did); nothing else is extrapolated.

What a measured step costs is read robustly. A GPU step's noise is one-sided (another process, a clock, a slow
phase of the allocator or of a freshly loaded graph only slows it down), and a profile measures each kind for few
steps, so a row's median can sit in a slow phase: two profiles of the probe measured its compiled bf16 step at
110.4 and 119.3 ms, and because the differences above subtract that anchor twice, they priced QuanGrad over float32
AdamW 8.5 % apart. The price of a row is instead its fastest steady step (the first, warm-up step left out) times
the profile's own ratio of median to fastest step for that compile mode (the median over its rows, about 1.01-1.02):

    T_row = min(steady steps) x median over the mode's rows of (row median / row fastest step)

so a price is a median-like figure (what a run's median measures) that no one slow phase moves. That holds for
compiled steps, whose kernels keep the GPU busy and whose slow phases pass. An eager step is set by the host, which
launches every kernel from Python, and its jitter is the step itself: the probe's eager checkpoint-all step at
micro-batch 1 x 2 measured 208.7-255.0 ms over five steady steps (both passes' medians 230.1 and 247.2 ms), so
its fastest step priced a plan of that kind at 211.2 ms, and `agoq train` ran it at 237.3 ms (-11 %); its median
prices it at 228.1 ms (-3.9 %). The host's speed also moves between runs: the profile measures each eager step in
two passes, and on an H100 the eager offloading step at 1 x 2 measured 234.9 and 283.9 ms in them; a plan priced
from the faster ran 242-286 ms (medians of thirds of a 60-step run). Eager rows are therefore priced by the mean of
their passes' medians (the row's median where it has one pass), and only compiled rows enter the ratio. Rows
without their per-step seconds (older profiles) are priced by their median.

Rows that offloaded (agoq-paper with its first K layers' saved tensors in host memory) price no plan by themselves:
they are kept apart (`offload_rows`), and `offload_step` pairs one with the agoq-paper step of the same knobs kept
on the GPU, from which agoq.search.costs prices offloading a layer.
"""

from __future__ import annotations

import statistics
from typing import Optional

from agoq.formats.measured_steps import COMPILE_MODES, find, measured_rows
from agoq.formats.profile import ProfileData

BASE_GRADIENTS = "bf16"
EAGER_SPREAD_NOTE = 0.05  # an eager split whose anchors' steady steps ranged more is noted (the 5 % target)
ROBUST_MODES = ("compiled",)  # priced by fastest step x ratio; the others by their median (module docstring)


class StepPrices:
    """The measured steps of one profile, and the step times they price (see the module docstring)."""

    def __init__(self, profile: ProfileData):
        every = measured_rows(profile.header, str(profile.path / "profile.json"))
        self.rows = [r for r in every if not r.get("offload_layers")]
        self.offload_rows = [r for r in every if r.get("offload_layers")]
        self.median_to_fastest = {  # per compile mode: the median over its rows of (row median / fastest step)
            mode: statistics.median(ratios) for mode in ROBUST_MODES
            if (ratios := [r["step_seconds"] / min(steady) for r in self.rows
                           if r["compile"] == mode and len(steady := self.steady(r)) >= 2])}
        self.m0 = int(profile.settings.get("micro_batch", 1) or 1)
        self.num_layers = profile.num_layers
        own = str(profile.settings.get("compile_mode") or "eager")
        self.modes = [c for c in [own] + [m for m in COMPILE_MODES if m != own] if self.base(c) is not None]

    # ------------------------------------------------------------------ what was measured

    @staticmethod
    def steady(row: dict) -> list[float]:
        """A row's measured seconds per step after the first (warm-up) step; [] where the row lacks them."""
        steps = row.get("seconds_per_step") or []
        return [float(t) for t in steps[1:] if t and t > 0]

    def price(self, row: dict) -> float:
        """The seconds a measured row prices its step at (module docstring): a compiled row its fastest steady step
        times the mode's median-to-fastest ratio; an eager row the mean of its passes' medians (its median where it
        has one pass); a row with fewer than two steady steps its median."""
        steady = self.steady(row)
        if row["compile"] not in ROBUST_MODES:
            passes = [float(t) for t in row.get("repeat_step_seconds") or [] if t and t > 0]
            return statistics.fmean(passes) if len(passes) >= 2 else float(row["step_seconds"])
        if len(steady) < 2 or row["compile"] not in self.median_to_fastest:
            return float(row["step_seconds"])
        return min(steady) * self.median_to_fastest[row["compile"]]

    def base(self, compile_mode: str) -> Optional[tuple[str, str]]:
        """(optimizer, masters) of the bf16 step at the profiled micro-batch in `compile_mode` (adamw8bit over fp32
        masters where several were measured), or None when there is none."""
        found = [(r["optimizer"], r["master"]) for r in self.rows
                 if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"],
                     r["activation_memory_budget"]) == (compile_mode, "bf16", self.m0, 1, BASE_GRADIENTS, None)]
        if not found:
            return None
        return ("adamw8bit", "fp32") if ("adamw8bit", "fp32") in found else sorted(found)[0]

    def row(self, compile_mode: str, policy: str, micro_batch: int, grad_accum: int, gradients: str = BASE_GRADIENTS,
            optimizer: Optional[str] = None, master: Optional[str] = None) -> Optional[dict]:
        """The measured step of exactly these knobs (optimizer and masters None: the mode's base)."""
        base = self.base(compile_mode)
        if base is None:
            return None
        return find(self.rows, compile=compile_mode, policy=policy, micro_batch=micro_batch, grad_accum=grad_accum,
                    gradients=gradients, optimizer=optimizer or base[0], master=master or base[1])

    def accumulations(self, compile_mode: str, policy: str, micro_batch: int, gradients: str = BASE_GRADIENTS,
                      optimizer: Optional[str] = None, master: Optional[str] = None) -> dict[int, float]:
        """{grad_accum: measured step seconds} of these knobs at `micro_batch`."""
        base = self.base(compile_mode)
        if base is None:
            return {}
        want = (compile_mode, policy, micro_batch, gradients, optimizer or base[0], master or base[1], None)
        return {r["grad_accum"]: self.price(r) for r in self.rows
                if (r["compile"], r["policy"], r["micro_batch"], r["gradients"], r["optimizer"], r["master"],
                    r["activation_memory_budget"]) == want}

    def splits(self, compile_mode: str) -> list[tuple[int, int]]:
        """The (micro_batch, grad_accum) pairs measured with the mode's bf16 anchor."""
        base = self.base(compile_mode)
        if base is None:
            return []
        return sorted({(r["micro_batch"], r["grad_accum"]) for r in self.rows
                       if (r["compile"], r["policy"], r["gradients"], r["optimizer"], r["master"],
                           r["activation_memory_budget"]) == (compile_mode, "bf16", BASE_GRADIENTS, *base, None)})

    def memory_budget_rows(self) -> list[dict]:
        """The compiled bf16 steps measured under torch.compile's activation_memory_budget."""
        return [r for r in self.rows if r["activation_memory_budget"] is not None]

    # ------------------------------------------------------------------ prices

    def _seconds(self, compile_mode: str, policy: str, micro_batch: int, grad_accum: int, gradients: str,
                 optimizer: Optional[str], master: Optional[str]) -> Optional[float]:
        """Seconds of a step of exactly these knobs: measured, or on the line through two measured accumulations
        of the same micro-batch."""
        points = self.accumulations(compile_mode, policy, micro_batch, gradients, optimizer, master)
        if grad_accum in points:
            return points[grad_accum]
        if len(points) < 2:
            return None
        (a1, t1), (a2, t2) = sorted(points.items())[:2]
        return t1 + (t2 - t1) / (a2 - a1) * (grad_accum - a1)

    def seconds(self, compile_mode: str, micro_batch: int, grad_accum: int, gradients: str = BASE_GRADIENTS,
                optimizer: Optional[str] = None, master: Optional[str] = None, policy: str = "bf16") -> Optional[float]:
        """T of the module docstring for one policy at these knobs, or None where the profile measured too little."""
        base = self.base(compile_mode)
        if base is None:
            return None
        optimizer, master = optimizer or base[0], master or base[1]
        exact = self._seconds(compile_mode, policy, micro_batch, grad_accum, gradients, optimizer, master)
        if exact is not None:
            return exact
        anchor = self._seconds(compile_mode, policy, micro_batch, grad_accum, BASE_GRADIENTS, *base)
        if anchor is None:
            return None
        if (optimizer, master) != base:
            theirs = self._seconds(compile_mode, "bf16", self.m0, 1, BASE_GRADIENTS, optimizer, master)
            ours = self._seconds(compile_mode, "bf16", self.m0, 1, BASE_GRADIENTS, *base)
            if theirs is None or ours is None:
                return None
            anchor += theirs - ours
        if gradients != BASE_GRADIENTS:
            theirs = self._seconds(compile_mode, "bf16", micro_batch, grad_accum, gradients, *base)
            ours = self._seconds(compile_mode, "bf16", micro_batch, grad_accum, BASE_GRADIENTS, *base)
            if theirs is None or ours is None:
                return None
            anchor += theirs - ours
        return anchor

    def spread(self, compile_mode: str, micro_batch: int, grad_accum: int) -> Optional[tuple[float, dict]]:
        """How far the steady steps of the anchors at this split (bf16, agoq-paper and checkpoint-all, the base
        knobs) ranged: (the largest of slowest / fastest - 1, that row), None where none has two steady steps."""
        found = []
        for policy in ("bf16", "agoq-paper", "checkpoint-all"):
            row = self.row(compile_mode, policy, micro_batch, grad_accum)
            steady = self.steady(row) if row is not None else []
            if len(steady) >= 2:
                found.append((max(steady) / min(steady) - 1.0, row))
        return max(found, key=lambda f: f[0]) if found else None

    def per_layer(self, compile_mode: str, policy: str, micro_batch: int, grad_accum: int) -> Optional[float]:
        """(T_policy - T_bf16) / L at the split with the base knobs: dQ or dC."""
        mine = self.seconds(compile_mode, micro_batch, grad_accum, policy=policy)
        bf16 = self.seconds(compile_mode, micro_batch, grad_accum)
        if mine is None or bf16 is None:
            return None
        return (mine - bf16) / self.num_layers

    def split_parts(self, compile_mode: str, micro_batch: int, gradients: str = BASE_GRADIENTS,
                    optimizer: Optional[str] = None, master: Optional[str] = None) -> Optional[tuple[float, float]]:
        """(seconds one more micro-batch of `micro_batch` sequences adds to a step: its fwd + bwd and accumulation,
        seconds of the rest of a one-micro-batch step: the optimizer step and what runs once), from the steps of
        one and of two micro-batches; None without both."""
        one = self.seconds(compile_mode, micro_batch, 1, gradients, optimizer, master)
        two = self.seconds(compile_mode, micro_batch, 2, gradients, optimizer, master)
        if one is None or two is None:
            return None
        return two - one, 2 * one - two

    def offload_row(self, compile_mode: str, micro_batch: int, grad_accum: int = 1) -> Optional[dict]:
        """The offloading step (agoq-paper, its first layers offloaded) measured in `compile_mode` at `micro_batch` x
        `grad_accum` with the base knobs, None where not measured."""
        base = self.base(compile_mode)
        if base is None:
            return None
        for r in self.offload_rows:
            if (r["compile"], r["policy"], r["micro_batch"], r["grad_accum"], r["gradients"], r["optimizer"],
                    r["master"], r["activation_memory_budget"]) == (compile_mode, "agoq-paper", micro_batch,
                                                                    grad_accum, BASE_GRADIENTS, *base, None):
                return r
        return None

    def offload_step(self, compile_mode: str, micro_batch: int, grad_accum: int = 1) -> Optional[dict]:
        """The offloading step measured in `compile_mode` at `micro_batch` x `grad_accum` with the base knobs, and the
        same step kept on the GPU: {"offloaded": its seconds, "kept": the kept step's seconds, "layers": K, "bytes":
        bytes offloaded per micro-batch}; None where either was not measured."""
        r = self.offload_row(compile_mode, micro_batch, grad_accum)
        kept = self.row(compile_mode, "agoq-paper", micro_batch, grad_accum)
        if r is None or kept is None:
            return None
        return {"offloaded": self.price(r), "kept": self.price(kept), "layers": int(r["offload_layers"]),
                "bytes": float(r.get("offloaded_bytes") or 0.0)}

    def compile_seconds(self, policy: str) -> Optional[float]:
        """Seconds a fresh process spends compiling one layer graph of `policy` (bf16: unmodified layers,
        agoq-paper: layers under LAAQ, checkpoint-all: checkpointed layers): the longest first compiled step the
        profile measured of that policy, less that step's steady seconds. The profile measures its steps in one
        process, so only the first of a kind compiles from nothing and the longest is that one; a process that finds
        its graphs in Inductor's cache compiles faster. None when no such step was measured."""
        spent = [float(r["first_step_seconds"]) - float(r["step_seconds"]) for r in self.rows
                 if r["compile"] == "compiled" and r["policy"] == policy and r["activation_memory_budget"] is None
                 and r.get("first_step_seconds") is not None]
        return max(max(spent), 0.0) if spent else None

    def missing(self, compile_mode: str, micro_batch: int, grad_accum: int, gradients: str, optimizer: str,
                master: str) -> Optional[str]:
        """Why these knobs cannot be priced (None: they can)."""
        if self.base(compile_mode) is None:
            return f"the profile measured no {compile_mode} step"
        if self.seconds(compile_mode, micro_batch, grad_accum) is None:
            have = ", ".join(f"{m} x {a}" for m, a in self.splits(compile_mode))
            return (f"the profile measured no {compile_mode} step at micro-batch {micro_batch} x {grad_accum} "
                    f"(measured: {have})")
        if self.seconds(compile_mode, micro_batch, grad_accum, gradients, optimizer, master) is None:
            return (f"the profile measured no {compile_mode} step with gradients {gradients}, optimizer {optimizer} "
                    f"and masters {master} at micro-batch {micro_batch} x {grad_accum}")
        return None


def prices(profile: ProfileData) -> StepPrices:
    """The profile's StepPrices, made once per loaded profile."""
    cached = profile.cache.get("step_prices")
    if cached is None:
        cached = profile.cache["step_prices"] = StepPrices(profile)
    return cached


def compile_modes(profile: ProfileData) -> list[str]:
    """Compile modes the profile measured a bf16 step in (its own mode first)."""
    return list(prices(profile).modes)


def profile_compile_mode(profile: ProfileData) -> str:
    """The compile mode the profile's memory steps and kernel times were measured in (eager unless it says)."""
    return str(profile.settings.get("compile_mode") or "eager")


__all__ = ["StepPrices", "prices", "compile_modes", "profile_compile_mode", "EAGER_SPREAD_NOTE"]
