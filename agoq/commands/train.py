"""Train a LLaMA-style model in plain bf16 (the baseline) or with a plan from `agoq search`.

One process trains on the CPU or one GPU. Under torchrun each process is one rank:
  torchrun --nproc-per-node 2 -m agoq.train MODEL --parallel ddp       (QuanGrad with a quangrad8 plan)
  torchrun --nproc-per-node 2 -m agoq.train MODEL --parallel fsdp      (FSDP2; TLq-HS with --gradients sdp4bit,
                                                    its weights gathered in 4 bits with --weight-gather int4)
  torchrun --nproc-per-node 4 -m agoq.train MODEL --parallel pipeline --grad-accum 8   (1F1B, stage bits)

Without --data a built-in synthetic corpus is used; a text file is read as bytes (vocabulary 256) or
with --tokenizer; the last 10 % is held out for validation. The run folder receives run.json,
metrics.jsonl (loss, grad_norm, lr, tokens_per_s, step_seconds, peak_bytes per rank each step,
val_loss every --eval-every steps) and checkpoints/ (written per rank with torch.distributed.checkpoint
every --checkpoint-every steps and at the end, the previous one kept until the new one is complete; none
with --checkpoint-every 0). Kill the run at any time and start it again with --resume, with the same or
another number of processes (same tokens per step: scale --grad-accum; a pipeline keeps its stages).

Stopping: SIGINT (Ctrl-C) or SIGTERM (what schedulers and torchrun send on preemption) lets the step in
progress finish on every rank (they agree on the step), saves a checkpoint at its end (not with
--checkpoint-every 0), marks run.json "stopped" and exits with 130: --resume then continues exactly as if
the run had never stopped (the same losses). A second signal stops at once, keeping the last checkpoint.
One process writes a run folder at a time (a lock on RUN_DIR/.lock, dropped when the process ends): a
second one on the same --out is refused (exit 2). run.json's "heartbeat" is refreshed every 30 s while the
run lives: a "running" run with an old heartbeat was killed.

With --plan the plan decides the activation bits and checkpointed layers, gradient storage, optimizer and
master weights, compile mode (training.compile: compiled is torch.compile per decoder layer in mode default),
micro-batch x accumulation and, under torchrun, the parallel mode of its launch: each is its flag's default. A
flag given with another value than the plan's is refused (exit 2): drop it, or search a plan for what you want.
A plan searched for an fsdp or pipeline layout runs only in the number of processes it was searched for
(its launch.command, which the refusal prints); a replicated plan runs in any.
--seq-len may differ (with a warning: the plan's predictions hold for its own). Plans of schema 1.0 say nothing
of optimizer or compile and train with AdamW on float32 masters, eager.

Before anything is built, a preset or config.json too big for the device is refused (exit 2), from its config:
weights, gradients, optimizer state and one sequence's layer inputs against the device's free memory (RAM on the
CPU), in GB, with how many layers would fit. An --out holding a profile is refused: a run gets its own folder.

Resuming keeps the run's settings: a changed one (--lr, --steps, --warmup, ...) is refused with a list
(old -> new) unless --override names it; batch shape, optimizer, master weights, parallel mode, gradients,
policy, dtype, seed, data and tokenizer cannot change (the checkpoint depends on them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "train a model in bf16 or with a plan, on one GPU or many (torchrun)"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `agoq train`'s arguments."""
    from agoq.commands.arguments import (
        integer,
        non_negative_float,
        non_negative_int,
        not_retired,
        positive_float,
        positive_int,
        positive_size_gb,
    )
    from agoq.vocabulary import (GRADIENT_MODES, MASTERS, OPTIMIZERS, PARALLEL_MODES, TRAIN_TORCH_COMPILE_MODES,
                                 WEIGHT_GATHERS)

    p = parser
    p.add_argument("model", help="preset (llama-tiny, probe, llama-3.2-1b, llama-3-8b) or a HuggingFace config.json (LLaMA, Qwen2, Mistral); "
                                 "its vocabulary is raised to the tokenizer's when smaller (recorded in run.json)")
    p.add_argument("--plan", default=None, help="plan.json from `agoq search` / `agoq profile --budget`: activation "
                                                "bits, checkpointed layers, gradient mode, optimizer and masters, "
                                                "compile mode, micro-batch x accumulation, batch shape and parallel "
                                                "mode, each the default of its flag; a flag given with another value "
                                                "is refused (default: none, plain bf16)")
    p.add_argument("--policy", default=None,
                   help="instead of a plan: an activation policy preset (agoq-paper, int8, int4, ...), a policy .json, "
                        "or stage-aware (agoq-paper with per-stage bits for --parallel pipeline)")
    p.add_argument("--gradients", choices=GRADIENT_MODES, default=None,
                   help="gradient storage and all-reduce: bf16 (the parameters' dtype), "
                        "quangrad8 (8-bit buffer and 8-bit all-reduce; with --parallel hsdp: the all-reduce across "
                        "nodes in 8 bits), sdp4bit (with --parallel fsdp or hsdp: int8/int4 TLq-HS gradient "
                        "reduce-scatter; with hsdp: int8 within a node, 4-bit all-reduce across) "
                        "(default: the plan's, else bf16)")
    p.add_argument("--checkpoint-all", action="store_true",
                   help="recompute every decoder layer in backward (activation checkpointing, the usual way to fit "
                        "a budget; what plans are compared with; with --plan only when it checkpoints every layer)")
    p.add_argument("--offload", default=None, metavar="LAYERS",
                   help="keep what these decoder layers save for backward in pinned host memory instead of on the GPU "
                        "(copied out on a side stream in forward, brought back a layer ahead in backward): all, "
                        "all-but-last (backward needs the last layer's at once), or indices and ranges like 0-5,8; "
                        "under a quantized policy or plan the packed codes travel, 4x fewer bytes than bf16 "
                        "(one GPU or DDP; default: the plan's offloaded layers, else none; with --plan "
                        "only the plan's own)")
    p.add_argument("--host-budget", type=positive_size_gb, default=None, metavar="GB",
                   help="with --offload or a plan that offloads: the most pinned host memory it may hold, in GB "
                        "(or a size with its unit, e.g. 30GiB); what would pass it stays on the GPU (default: the "
                        "plan's host_budget_bytes, else no cap, about one micro-batch of the offloaded layers' "
                        "activations)")
    # None: not given, so the plan's value (else eager) applies; given values are checked against a plan
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each decoder layer on its own (any policy, plan or --checkpoint-all; on the "
                        "CPU too, through Inductor's C++ backend); --no-compile: eager "
                        "(default: the plan's training.compile, else on with a CUDA GPU in one process or DDP, where "
                        "it was measured faster, and eager on the CPU and with fsdp or pipeline)")
    p.add_argument("--compile-mode", default=None,
                   choices=TRAIN_TORCH_COMPILE_MODES,
                   help="torch.compile's mode with --compile: reduce-overhead records each layer as CUDA graphs "
                        "(refused with stochastic rounding, whose host-drawn seeds a graph would freeze); a compiled "
                        "plan was priced in mode default (default: default)")
    p.add_argument("--activation-memory-budget", type=float, default=None, metavar="B",
                   help="with --compile: torch.compile's partitioner recomputes to keep about B (0 < B <= 1) of the "
                        "activations it would save (torch._functorch.config.activation_memory_budget; compile's own "
                        "memory saver) (default: the plan's training.activation_memory_budget, else 1)")
    p.add_argument("--data", default=None, help="text file to train on, split 90/10 into train/validation "
                                                "(default: a built-in synthetic corpus, 1 MB)")
    p.add_argument("--tokenizer", default=None, help="HuggingFace tokenizers JSON (default: bytes, vocabulary 256)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (default: the plan's, else 256)")
    p.add_argument("--micro-batch", type=positive_int, default=None,
                   help="sequences per micro-batch and rank (default: the plan's training.micro_batch, else 8)")
    p.add_argument("--grad-accum", type=positive_int, default=None,
                   help="micro-batches per optimizer step; with --parallel pipeline the 1F1B micro-batches, at least "
                        "the number of stages (default: the plan's training.grad_accum, else 1; pipeline: the "
                        "number of stages)")
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (default 1e-3); "
                                                                   "cosine decay to lr/10 after warmup")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="linear warmup steps (default: min(100, steps/10))")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (default 0.1)")
    p.add_argument("--clip", type=non_negative_float, default=1.0, help="clip the gradient norm to this (0: off; default 1.0)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="adamw (float32 moments) or adamw8bit (8-bit block-quantized moments, float32 update); "
                        "(default: the plan's optimizer.name, "
                        "else adamw)")
    p.add_argument("--master", choices=MASTERS, default=None,
                   help="with --optimizer adamw8bit and bf16 parameters: fp32 keeps float32 master weights in the "
                        "optimizer (4 bytes per parameter); none updates the bf16 parameters directly with "
                        "stochastic rounding (default: the plan's optimizer.master, else fp32; --optimizer adamw "
                        "always keeps fp32 masters)")
    p.add_argument("--parallel", type=not_retired, choices=PARALLEL_MODES, default=None,
                   help="how several processes share the work: ddp (replicas), fsdp (PyTorch's FSDP2, one unit per decoder layer, float32 shards with bf16 "
                        "compute), hsdp (FSDP2 sharded within a node of --node-size ranks, replicated across nodes; "
                        "--gradients quangrad8 or sdp4bit all-reduce across nodes in 8 or 4 bits), pipeline "
                        "(default: the plan's launch.parallel when it is fsdp, hsdp or "
                        "pipeline and this run has several processes, else none for one process, ddp under "
                        "torchrun). agoq's own sharded mode (sharded) was retired: run fsdp --gradients sdp4bit "
                        "--weight-gather int4 --node-size 1 instead")
    p.add_argument("--pipeline-stages", type=positive_int, default=None,
                   help="pipeline stages (must equal the number of processes; default: the number of processes)")
    p.add_argument("--node-size", type=positive_int, default=None,
                   help="ranks per node: for SDP4Bit's gradient reduce-scatter (--parallel fsdp with "
                        "--gradients sdp4bit) int8 inside a node, int4 across nodes; for --parallel hsdp the ranks "
                        "that shard the state (replicated across the world / node-size nodes) "
                        "(default: torchrun's LOCAL_WORLD_SIZE; 1 treats every GPU as a node)")
    p.add_argument("--weight-gather", choices=WEIGHT_GATHERS, default="bf16",
                   help="with --parallel fsdp or hsdp: how FSDP2 all-gathers the weight matrices in forward and "
                        "backward: "
                        "bf16 (its own, in the compute dtype), int8 (ZeRO++'s qwZ: block-wise int8 codes with one "
                        "float32 scale per 256 values, about half of bf16's bytes; each value within half a step "
                        "of its block's absmax / 127), int4 (4-bit codes after a Hadamard-32 transform, about a "
                        "quarter; 12.6 %% relative error against int8's 0.7 %%, not shown to hold the loss) "
                        "(default bf16)")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=100,
                   help="save a checkpoint every N steps, at the end, and at the step boundary where SIGINT / "
                        "SIGTERM stopped the run (0: no checkpoint is written at all; default 100)")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help="validation loss every N steps and at the end (default: steps/10)")
    p.add_argument("--eval-batches", type=positive_int, default=8,
                   help="validation micro-batches per evaluation (default 8)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint "
                                                        "(starts from step 0 when it has none) with the same "
                                                        "settings: a changed one is refused unless --override "
                                                        "names it")
    p.add_argument("--override", default=(), metavar="NAMES",
                   help="with --resume: the settings, comma-separated, that may differ from the run's (e.g. "
                        "lr,steps,warmup; names as in run.json's settings, - or _ alike). Each must be named: "
                        "there is no blanket override, so a changed default (warmup and eval_every follow --steps) "
                        "cannot slip in unseen. Accepted changes are recorded in run.json (resumed[].changed, "
                        "original_settings). Batch shape, optimizer, master, parallel, gradients, policy, dtype, "
                        "seed, data and tokenizer cannot change (default: none)")
    p.add_argument("--seed", type=integer, default=0, help="seed of the weights and the data order (default 0)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None,
                   help="parameter and activation dtype (default: bf16 on GPUs, fp32 on the CPU); with bf16 the "
                        "optimizer keeps float32 master weights")
    p.add_argument("--out", default="runs/train", help="run folder: run.json, metrics.jsonl, checkpoints/ "
                                                       "(default runs/train)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _plan_or_none(path):
    """The --plan, or None when there is none or it cannot be read (agoq.train reports why, in its words)."""
    if path is None:
        return None
    from agoq.formats.plan import load_plan

    try:
        return load_plan(path)
    except (ValueError, OSError):
        return None


def _check_out(out: Path) -> None:
    """Refuse an --out holding a profile (agoq profile's folder): a run is written into a folder of its own, and
    the dashboard reads a folder as one or the other. A folder holding a run is the trainer's to judge (--resume)."""
    if (out / "profile.json").is_file():
        raise ValueError(f"--out {out} holds a profile (profile.json), not a run: give the run a folder of its own")


def _check_size(args: argparse.Namespace) -> None:
    """Refuse a model too big for this device before anything is built (agoq.models.size_check), with the settings
    this run will take where they can be known here: the flags, else the plan's (--plan), else the run's (--resume),
    else the defaults; where not known, the floor's smallest. A plan's sequence length longer than the model's
    positions is refused naming the plan's field, not a --seq-len the user never gave."""
    import os

    import torch

    from agoq.formats.run import read_run
    from agoq.models import resolve_config
    from agoq.models.size_check import check_fits
    from agoq.train.plan_settings import BATCH_DEFAULTS

    try:
        config = resolve_config(args.model)
    except (ValueError, NotImplementedError, OSError, TypeError):
        return  # agoq.train says what is wrong with it
    plan = _plan_or_none(args.plan)
    seq_len, seq_from = args.seq_len, "--seq-len"
    if seq_len is None and plan is not None:
        seq_len, seq_from = plan.training.seq_len, f"training.seq_len of the plan {args.plan}"
        if seq_len > config.max_position_embeddings:
            raise ValueError(f"{args.plan}: training.seq_len {seq_len} exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings}): the plan cannot run on {args.model} as written; "
                             f"search a plan from a profile of this model, or give --seq-len at most "
                             f"{config.max_position_embeddings} (the plan's predictions hold for its own)")
    if seq_len is None:
        settings = (read_run(args.out) or {}).get("settings") or {} if args.resume else {}
        seq_len = settings.get("seq_len") if args.resume else BATCH_DEFAULTS["seq_len"]
        seq_len = seq_len if isinstance(seq_len, int) and seq_len > 0 else 1
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or 1)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return  # agoq.train refuses it
        device = device if ":" in device else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    dtype = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    planned = plan is not None and plan.states_run_settings()["optimizer"]
    optimizer = args.optimizer or (plan.optimizer.name if planned else "adamw")
    master = "fp32" if optimizer == "adamw" else args.master or (plan.optimizer.master if planned else "fp32")
    gradients = args.gradients or (plan.gradients.mode if plan is not None else "bf16")
    check_fits(config, device=device, dtype=dtype, seq_len=seq_len, what=f"model {args.model}",
               fewer_layers="a config.json with fewer num_hidden_layers", seq_len_from=seq_from,
               processes_here=local, optimizer=optimizer, master=master,
               gradient_bytes=None if gradients == "bf16" else 1, share=world)


def run(args: argparse.Namespace) -> int:
    """Run `agoq train` with parsed arguments; returns the exit code (1 when training failed)."""
    from agoq.train.trainer import TrainConfig, train

    _check_out(Path(args.out))
    _check_size(args)

    cfg = TrainConfig(model=args.model, plan=args.plan, policy=args.policy, gradients=args.gradients,
                      data=args.data, tokenizer=args.tokenizer, seq_len=args.seq_len, micro_batch=args.micro_batch,
                      grad_accum=args.grad_accum, steps=args.steps, lr=args.lr, warmup=args.warmup,
                      weight_decay=args.weight_decay, clip=args.clip, optimizer=args.optimizer, master=args.master,
                      parallel=args.parallel, pipeline_stages=args.pipeline_stages,
                      checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, resume=args.resume, seed=args.seed, device=args.device,
                      dtype=args.dtype, out=args.out, checkpoint_all=args.checkpoint_all,
                      offload=args.offload, host_budget=args.host_budget, node_size=args.node_size,
                      weight_gather=args.weight_gather,
                      quiet=args.quiet, compile=args.compile,
                      compile_mode=args.compile_mode, activation_memory_budget=args.activation_memory_budget,
                      override=args.override)
    return train(cfg)
