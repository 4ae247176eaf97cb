"""The training loop behind `agoq train`: one process, or DDP / FSDP2 (fsdp, hsdp) / pipeline under torchrun.

`train(TrainConfig(...))` prepares the run (`agoq.train.preparation`: the data and the model, with the plan or an
activation policy, checkpointing, compilation and the parallel strategy applied in one ordered step,
`agoq.train.apply.apply_plan`; the strategy of the run's dims also holds the gradient storage), builds the
optimizer (`agoq.train.optimizer`: AdamW or 8-bit AdamW), then runs `steps` optimizer
steps (`Trainer.step`, which `agoq.train.measure` runs too), writing RUN_DIR/run.json, RUN_DIR/metrics.jsonl and
atomic per-rank checkpoints through torch.distributed.checkpoint, which a run of another world size resumes
(`agoq.train.checkpoint`; docs/formats.md, "Run"). Everything that can be wrong with the inputs is checked before
the first step (`agoq.train.config`, then `prepare`).

Numerics: parameters live in `dtype` (bf16 on GPUs by default); when that is not float32 the
optimizer steps float32 master copies and writes them back rounded. The loss is the mean token
cross-entropy over the step's micro-batches (and data-parallel ranks), computed by the chunked LM
head. The learning rate warms up linearly for `warmup` steps, then follows a cosine to `lr/10`.
"""

from __future__ import annotations

import math
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from agoq.environment import hardware, software_versions
from agoq.files import check_output_folder, json_safe
from agoq.formats.run import RunRecord, read_run
from agoq.progress import progress_bar
from agoq.train import collector
from agoq.train.checkpoint import clean_partial, find_checkpoint, load_checkpoint, refuse_retired, save_checkpoint
from agoq.train.config import OPTIMIZERS, PARALLEL_MODES, JobConfig, TrainConfig
from agoq.train.optimizer import BETAS
from agoq.train.plan_check import PlanCheck
from agoq.train.parallel import World, join_world
from agoq.train.preparation import PreparedRun, prepare
from agoq.train.resume_settings import FIXED_SETTINGS, changed_settings, check_layout, check_override, difference
from agoq.train.stopping import RunFolderBusy, RunLock, StopSignals


class TrainingFailed(RuntimeError):
    """The run stopped on its own: a non-finite loss or gradient."""


def lr_at(step: int, cfg: JobConfig, warmup: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine from lr to lr/10."""
    lr = cfg.optim.lr
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, cfg.loop.steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _peak_bytes(device: torch.device) -> int:
    """The step's peak: the GPU's allocated bytes since the step began; on the CPU the process's largest resident
    set so far."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass(frozen=True)
class StepResult:
    """One optimizer step's figures: the mean loss and the gradient norm (over the ranks), the learning rate, its
    seconds, each rank's peak bytes (`_peak_bytes`) and this rank's peak of the allocator's reserved bytes (None off
    the GPU): what it held from the device, freed blocks waiting for a side stream (offload's copies) included."""

    loss: float
    grad_norm: float
    lr: float
    seconds: float
    peak_bytes: list[int]
    reserved_bytes: int | None = None


class Trainer:
    """One run: the parallel strategy, the optimizer, checkpointing and the step loop."""

    def __init__(self, prepared: PreparedRun, stop: StopSignals | None = None):
        self.prepared = prepared
        self.stop = stop  # SIGINT / SIGTERM seen by this process (None: never asked to stop)
        self.changed: dict[str, list] = {}  # settings this resume changed, {name: [old, new]}
        self.cfg, self.world, self.device, self.shape = prepared.cfg, prepared.world, prepared.device, prepared.shape
        self.record = RunRecord(self.cfg.checkpoint.out) if self.world.rank == 0 else None
        self.parallel = prepared.strategy
        self.module = self.parallel.module
        self.optimizer_step = self.parallel.build_optimizer(self.cfg.optim, self.cfg.loop.seed)
        self.optimizer = self.optimizer_step.optimizer
        self._frozen = False  # the objects the first step left are frozen out of the collector (agoq.train.collector)

    # ---------------------------------------------------------------- run description

    def _settings(self) -> dict:
        p, cfg, shape = self.prepared, self.cfg, self.shape
        optim, model = cfg.optim, cfg.model
        return {"seq_len": shape.seq_len, "micro_batch": shape.micro_batch, "grad_accum": shape.grad_accum,
                "steps": cfg.loop.steps, "lr": optim.lr, "warmup": p.warmup, "optimizer": optim.optimizer,
                "master": optim.master if p.dtype != torch.float32 else "none (float32 parameters)",
                "parallel": p.layout.mode, "data": p.corpus_info["data"], "seed": cfg.loop.seed,
                "gradients": p.gradients, "policy": p.policy_name, "dtype": str(p.dtype).replace("torch.", ""),
                "weight_decay": optim.weight_decay, "clip": optim.clip, "betas": list(BETAS),
                "min_lr": optim.lr * 0.1, "schedule": "linear warmup, cosine to lr/10",
                "checkpoint_every": cfg.checkpoint.checkpoint_every, "eval_every": p.eval_every,
                "eval_batches": cfg.loop.eval_batches, "pipeline_stages": self.parallel.pipeline_stages,
                "layer_stage": p.layer_stage, "tokens_per_step": self.tokens_per_step,
                "checkpoint_all": cfg.memory.checkpoint_all, "offload": p.offload_layers,
                "host_budget_gb": None if p.host_budget_bytes is None else p.host_budget_bytes / 1e9,  # bytes inside
                "compile": model.compile,
                "compile_mode": model.compile_mode if model.compile else None, "node_size": cfg.parallelism.node_size,
                "weight_gather": cfg.parallelism.weight_gather,
                "activation_memory_budget": model.activation_memory_budget if model.compile else None,
                **{k: v for k, v in p.corpus_info.items() if k != "data"}}

    @property
    def tokens_per_step(self) -> int:
        return self.shape.seq_len * self.shape.micro_batch * self.shape.grad_accum * self.parallel.data_ranks

    def _resume_key(self) -> dict:
        """What a checkpoint's state depends on. One process and DDP keep the same replicated state, so their
        checkpoints are interchangeable (a DDP run resumes in one process with the same tokens per step)."""
        settings = self._settings()
        key = {"fingerprint": self.prepared.spec["fingerprint"], **{k: settings[k] for k in FIXED_SETTINGS}}
        key["parallel"] = self.prepared.layout.resume_state
        return key

    # ---------------------------------------------------------------- checkpoints

    def _state(self, ranks_saved: int | None = None) -> dict:
        """This rank's checkpoint state dict (torch.distributed.checkpoint's): model and optimizer by parameter
        name (a pipeline stage's under "stage{rank}", since stages name their layers alike), and this rank's RNG
        states under "rng.rank{rank}". For a load, `ranks_saved` is the saving run's world size: a rank it did
        not have reads no RNG state."""
        state = self.optimizer_step.checkpoint_state(self.module)
        if self.parallel.pipeline_stages > 1:
            state = {f"stage{self.world.rank}": state}
        if ranks_saved is None or self.world.rank < ranks_saved:
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            state["rng"] = {f"rank{self.world.rank}": (torch.get_rng_state(), random.getstate(), cuda)}
        return state

    def _restore(self, state: dict) -> None:
        """Put a loaded `_state()` to work: model, optimizer, RNG states."""
        mine = state[f"stage{self.world.rank}"] if self.parallel.pipeline_stages > 1 else state
        self.optimizer_step.restore(self.module, mine)
        rng = state.get("rng", {}).get(f"rank{self.world.rank}")
        if rng is not None:
            torch.set_rng_state(rng[0].cpu())
            random.setstate(rng[1])
            if rng[2] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng[2].cpu(), self.device)

    def save(self, step: int) -> None:
        info = {"resume": self._resume_key(), "parallel": self.prepared.layout.mode,
                "dims": self.prepared.layout.dims.to_dict(),
                "pipeline_stages": self.parallel.pipeline_stages, "layer_stage": self.prepared.layer_stage}
        save_checkpoint(self.cfg.checkpoint.out, step, self._state(), json_safe(info), rank=self.world.rank,
                        world=self.world.size, barrier=self.world.barrier)

    def try_resume(self) -> int | None:
        """Load the newest complete checkpoint when --resume; returns its step (None: starting fresh).

        A data-parallel checkpoint resumes at any world size with the same tokens per step; a pipeline's with
        the same stages; one of the retired --parallel sharded is refused (agoq.train.checkpoint)."""
        world = self.world
        out = Path(self.cfg.checkpoint.out)
        found = find_checkpoint(out)
        if not self.cfg.checkpoint.resume:
            if found is not None or (out / "metrics.jsonl").exists():
                raise ValueError(f"{out} already holds a run: add --resume to continue it, or give another --out")
            return None
        check_override(self._settings(), self.cfg.checkpoint.override)
        if found is None:
            if world.rank == 0:
                print(f"agoq train: no checkpoint in {out} yet: starting from step 0", file=sys.stderr)
            return None
        folder, state = refuse_retired(found)
        mine = json_safe(self._resume_key())
        theirs = state.get("resume", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        old_settings = (read_run(out) or {}).get("settings") or {}
        old_data, new_data = old_settings.get("data"), self.prepared.corpus_info["data"]
        if diff:
            hint = (" (with another number of processes, scale --grad-accum to keep tokens_per_step)"
                    if "tokens_per_step" in diff else "")
            raise ValueError(f"cannot resume {folder}: settings differ from the checkpoint's "
                             + ", ".join(difference(k, a, b, old_data, new_data) for k, (a, b) in diff.items())
                             + " (the checkpoint's state depends on these: --override cannot change them)" + hint)
        if old_data is not None and old_data != new_data and world.rank == 0:
            print(f"agoq train: the data is read from {new_data} now (the run began on {old_data}; the same "
                  "content)", file=sys.stderr)
        check_layout(folder, state, world_size=self.world.size, dims=self.prepared.layout.dims,
                     reshardable=self.optimizer_step.reshardable, stages=self.parallel.pipeline_stages,
                     layer_stage=json_safe(self.prepared.layer_stage))
        self.changed = changed_settings(json_safe(self._settings()), old_settings, self.cfg.checkpoint.override, out)
        if self.changed and world.rank == 0:
            print("agoq train: resuming with changed settings (--override): "
                  + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self.changed.items()), file=sys.stderr)
        if state.get("world") != world.size and world.rank == 0:
            print(f"agoq train: resuming a checkpoint of {state.get('world')} processes with {world.size}",
                  file=sys.stderr)
        destination = self._state(ranks_saved=int(state.get("world", 1)))
        load_checkpoint(folder, destination)
        self._restore(destination)
        world.barrier()
        return int(state["step"])

    # ---------------------------------------------------------------- one step

    def _zero(self) -> None:
        self.parallel.zero_grad()
        self.optimizer_step.zero_grad()

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Every micro-batch of `step`: returns this rank's mean loss (a float32 tensor; 0 where it has none)."""
        return self.parallel.forward_backward(self.prepared.batches, step, self.shape.grad_accum,
                                              self.prepared.before_micro_batch)

    def _gradients(self):
        """After backward: the gradients the optimizer will use (see ParallelStrategy.gradients)."""
        return self.parallel.gradients(fused=self.optimizer_step.fused)

    def _grad_norm(self, grads) -> float:
        """L2 norm of the gradient the optimizer applies (with several ranks: of the averaged gradient)."""
        return self.parallel.grad_norm(grads, fused=self.optimizer_step.fused)

    def clip_scale(self, norm: float) -> float:
        """The factor that clips the gradient norm to --clip (1: no clipping)."""
        clip = self.cfg.optim.clip
        return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0

    def _apply(self, grads, scale: float) -> None:
        """Give the optimizer its gradients (scaled by `scale` for clipping) and take the step."""
        self.optimizer_step.step(grads, scale)

    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches."""
        return self.parallel.evaluate(self.prepared.batches, self.cfg.loop.eval_batches)

    def step(self, step: int) -> StepResult:
        """Optimizer step `step` (0-based): the learning rate of the schedule, every micro-batch's forward and
        backward, the gradients reduced, clipped and applied. Raises TrainingFailed, the step not taken, when the
        loss or the gradient norm is not finite."""
        device = self.device
        lr = lr_at(step, self.cfg, self.prepared.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        self._zero()
        loss_local = self._forward_backward(step)
        grads = self._gradients()
        loss = self.parallel.mean_over_ranks(loss_local)
        norm = self._grad_norm(grads)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise TrainingFailed(f"step {step + 1}: the loss is {loss} and the gradient norm {norm} (not finite); "
                                 "the step was not taken")
        self._apply(grads, self.clip_scale(norm))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        reserved = int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None
        if not self._frozen:  # after the step, outside its time: what the warm-up built is kept from collections
            self._frozen = collector.freeze_after_warmup()
        return StepResult(loss, norm, lr, seconds, self.world.gather_ints(_peak_bytes(device), device), reserved)

    # ---------------------------------------------------------------- the run

    def _lock_run_folder(self) -> RunLock | None:
        """Rank 0 locks the run folder; every rank raises RunFolderBusy when another process holds it."""
        lock, busy = None, None
        if self.world.rank == 0:
            lock = RunLock(self.cfg.checkpoint.out)
            try:
                lock.acquire()
            except RunFolderBusy as e:
                lock, busy = None, e
        if self.world.any(busy is not None, self.device):  # the other ranks learn it here
            raise busy or RunFolderBusy(f"{self.cfg.checkpoint.out} is in use by another agoq train (see rank 0)")
        return lock

    def close(self) -> None:
        """Give what the first step froze back to the collector (agoq.train.collector.thaw), so that this run's model
        and optimizer can be freed once dropped."""
        if self._frozen:
            collector.thaw()
            self._frozen = False

    def run(self) -> int:
        lock = self._lock_run_folder()
        try:
            return self._run()
        finally:
            self.close()
            if self.record is not None:
                self.record.stop_heartbeat()
            if lock is not None:
                lock.release()

    def _stop_requested(self) -> bool:
        """Whether any rank received SIGINT / SIGTERM (every rank calls it once per step: they agree)."""
        return self.world.any(self.stop is not None and self.stop.requested, self.device)

    def _run(self) -> int:
        p, cfg, world, device = self.prepared, self.cfg, self.world, self.device
        out, steps = cfg.checkpoint.out, cfg.loop.steps
        if world.rank == 0:
            Path(out).mkdir(parents=True, exist_ok=True)
            clean_partial(out)
        world.barrier()
        resumed = self.try_resume()
        start = resumed or 0
        if self.record is not None:
            world_info = {"size": world.size, "local_size": world.local_size, "backend": world.backend}
            self.record.start({"model": p.spec, "plan": p.plan_record, "settings": self._settings(),
                               "world": world_info, "hardware": hardware(device, world.size),
                               "software": software_versions()}, resumed, self.changed)
            self.record.start_heartbeat()
        bar = None
        if world.rank == 0 and not cfg.loop.quiet:
            bar = progress_bar(total=steps, initial=start, desc="train", unit="step")
        check = None
        if p.plan is not None and self.record is not None and start == 0:  # a resumed run's first step is no first
            stage = world.rank if p.layer_stage is not None else None
            check = PlanCheck(p.plan, stage, peaks=device.type == "cuda", device=hardware(device, 1)["name"]
                              if device.type == "cuda" else "cpu")
            if world.rank == 0 and check.device_warning():  # said now: the run may not be worth its time
                self._say_plan_warnings([check.device_warning()], bar)
        last_saved = start
        step = start
        if start < steps and self._stop_requested():  # a signal while the run was being prepared
            return self._end(bar, start, "stopped", f"stopped by {self._stopper()} before step {start + 1}; "
                             f"--resume continues from step {start}", 130)
        try:
            for step in range(start, steps):
                try:
                    result = self.step(step)
                except TrainingFailed as e:
                    raise TrainingFailed(f"{e}. The last good checkpoint (step {last_saved}) is kept: lower --lr or "
                                         "raise --warmup, then --resume") from None
                done = step + 1
                if self.record is not None:
                    self.record.append({"step": done, "loss": result.loss, "grad_norm": result.grad_norm,
                                        "lr": result.lr, "tokens_per_s": self.tokens_per_step / result.seconds,
                                        "step_seconds": result.seconds, "peak_bytes": result.peak_bytes,
                                        "peak_reserved_bytes": result.reserved_bytes,
                                        "time": time.time()})
                if check is not None:
                    check.add(result.seconds, result.peak_bytes)
                    if check.due(done, steps):
                        self._record_plan_check(check, bar)
                if done % p.eval_every == 0 or done == steps:
                    val = self.evaluate()
                    if self.record is not None:
                        self.record.append({"step": done, "val_loss": val, "time": time.time()})
                    if not math.isfinite(val):
                        raise TrainingFailed(f"step {done}: the validation loss is {val}. The last good checkpoint "
                                             f"(step {last_saved}) is kept")
                every = cfg.checkpoint.checkpoint_every
                if every > 0 and (done % every == 0 or done == steps):
                    self.save(done)
                    last_saved = done
                if self.record is not None:
                    if done % 10 == 0 or done == steps:
                        self.record.update(done)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{result.lr:.2e}")
                if self._stop_requested() and done < steps:
                    # the step has ended on every rank: save it, so that --resume continues exactly from here
                    if every > 0 and last_saved != done:
                        self.save(done)
                        last_saved = done
                    saved = (f"checkpoint saved at step {done}" if last_saved == done else
                             "no checkpoint written (--checkpoint-every 0)" if every == 0 else
                             f"last checkpoint at step {last_saved}")
                    return self._end(bar, done, "stopped", f"stopped by {self._stopper()} after step {done}; "
                                     f"{saved}; --resume continues from step {last_saved}", 130)
        except TrainingFailed as e:
            return self._end(bar, step, "failed", str(e), 1)
        except KeyboardInterrupt:
            return self._end(bar, step, "stopped", f"interrupted at step {step}; --resume continues from step "
                                                   f"{last_saved}", 130, say=False)
        if self.record is not None and p.offload is not None:
            self.record.note(offload=p.offload.stats.to_dict())
        self._end(bar, steps, "finished", None, 0, say=False)
        if self.record is not None:
            print(f"agoq train: finished {steps} steps; run in {out}", file=sys.stderr)
        return 0

    def _record_plan_check(self, check: PlanCheck, bar) -> None:
        """Write the run against its plan into run.json and say what is off (agoq.train.plan_check)."""
        report = check.report()
        self.record.note(plan_check=report)
        fresh = [w for w in report["warnings"] if w != check.device_warning()]  # that one was said at the start
        if fresh and not check.warned:  # the first comparison that finds something says it; later ones record it
            check.warned = True
            self._say_plan_warnings(fresh, bar)

    @staticmethod
    def _say_plan_warnings(warnings: list[str], bar) -> None:
        """Say `warnings` on stderr (above the progress bar, where there is one)."""
        for warning in warnings:
            text = f"agoq train: warning: {warning}"
            if bar is not None:
                bar.write(text, file=sys.stderr)
            else:
                print(text, file=sys.stderr)

    def _stopper(self) -> str:
        return self.stop.name if self.stop else "another rank"

    def _end(self, bar, step: int, status: str, message: str | None, code: int, say: bool = True) -> int:
        """Close the progress bar, record how the run ended in run.json (rank 0), say it; returns `code`."""
        if bar is not None:
            bar.close()
        if self.record is not None:
            self.record.update(step, status, message)
            if say:
                print(f"agoq train: {message}", file=sys.stderr)
        return code


def train(cfg: JobConfig) -> int:
    """Run one training (in this process; under torchrun, this rank's part); returns the exit code.

    SIGINT (Ctrl-C) or SIGTERM (what torchrun and schedulers send) lets the step in progress finish, saves a
    checkpoint at its end (every rank stops after the same step), then stops: status "stopped", exit 130.
    A second signal stops at once, keeping the last checkpoint.
    """
    check_output_folder(cfg.checkpoint.out, "--out")  # every rank writes its checkpoint shards there
    with StopSignals() as stop:
        world = join_world(cfg.model.device)
        try:
            return Trainer(prepare(cfg, world), stop).run()
        finally:
            if world.initialised_here:
                dist.destroy_process_group()


__all__ = ["TrainConfig", "JobConfig", "train", "prepare", "Trainer", "StepResult", "World", "lr_at",
           "TrainingFailed", "PARALLEL_MODES", "OPTIMIZERS"]
