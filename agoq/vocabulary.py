"""The words agoq's stages share, each defined once: gradient modes, optimizers and masters, compile modes, the
search's layouts and the runtime's parallel modes (with the mapping between them).

Plans, profiles, the search's flags and `agoq train`'s flags all speak these words; every module that checks or
offers one imports it from here (tests/test_vocabulary.py holds the plan's Literal types and the commands' choices
to them). Nothing heavy is imported: the search, the formats and the command line read this module without torch.

Two meanings of "compile" are kept apart by their names:

  COMPILE_MODES        how a plan's decoder layers run: eager, or compiled (torch.compile per decoder layer);
                       a plan's `training.compile`, a measured step's `compile`, `agoq search --compile`
  TORCH_COMPILE_MODES  torch.compile's own `mode=` argument when compiled ("default", "reduce-overhead", ...);
                       `agoq train --compile-mode`

Layouts and parallel modes: the search prices a plan in a layout (how the ranks keep the state: replicated;
fsdp, sharded over every rank by PyTorch's FSDP2 with agoq's collectives; or hsdp, FSDP2 over replicas of a node's
shards: replicate across nodes, shard within, offered where the ranks span nodes) and, with pipeline stages, one
stage per process; the runtime runs it in a parallel mode (`agoq train --parallel`) of the same word.
`PARALLEL_LAYOUT` maps each parallel mode to the layout it runs and `parallel_mode` a plan's layout, stages and
processes to the mode that launches it.

agoq's own sharded path (layout and parallel mode "sharded": SDP4Bit's sharded AdamW over flat shards, plan engine
"sdp4bit") was retired once FSDP2 with agoq's collectives ran faster at less memory per rank (docs/results.md):
the word is kept only to refuse it, with `SHARDED_RETIRED` saying what to run instead.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------------ gradient storage

BF16, QUANGRAD8, SDP4BIT = "bf16", "quangrad8", "sdp4bit"
GRADIENT_MODES = (BF16, QUANGRAD8, SDP4BIT)  # bf16; QuanGrad's 8-bit buffer and all-reduce; SDP4Bit's reduce-scatter
# the gradient storage a replica keeps whole (what a profile measures its steps and state with): sdp4bit is sharded
REPLICA_GRADIENT_MODES = (BF16, QUANGRAD8)
# FSDP2's weight all-gather (`agoq train --weight-gather`): its own in the compute dtype; block codes (ZeRO++'s qwZ)
WEIGHT_GATHERS = (BF16, "int8", "int4")

# ------------------------------------------------------------------------------------------ the optimizer step

ADAMW, ADAMW8BIT = "adamw", "adamw8bit"
OPTIMIZERS = (ADAMW, ADAMW8BIT)  # torch's AdamW (float32 moments); agoq's fused 8-bit AdamW
MASTERS = ("fp32", "none")  # float32 master weights; none (bf16 parameters, stochastic rounding: adamw8bit only)

# ------------------------------------------------------------------------------------------ compiling

EAGER, COMPILED = "eager", "compiled"
COMPILE_MODES = (EAGER, COMPILED)  # how the decoder layers run (compiled: torch.compile per decoder layer)
# torch.compile's `mode=`: the last two record CUDA graphs (agoq.runtime.activations.compile)
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
TRAIN_TORCH_COMPILE_MODES = TORCH_COMPILE_MODES[:3]  # what `agoq train --compile-mode` offers
PLAN_TORCH_COMPILE_MODE = "default"  # the torch.compile mode a compiled plan is measured and priced in

# ------------------------------------------------------------------------------------------ layouts and modes

REPLICATED, FSDP = "replicated", "fsdp"
HSDP = "hsdp"  # FSDP2 over a 2-D mesh: replicas across nodes of the shards within a node (--node-size ranks)
LAYOUTS = (REPLICATED, FSDP, HSDP)  # the search's: how the ranks keep the model and optimizer state
FSDP2_LAYOUTS = (FSDP, HSDP)  # the layouts PyTorch's FSDP2 runs (units all-gathered, gradients reduce-scattered)
# the retired own sharded path: its layout / parallel mode word and plan engine, refused wherever they are read
SHARDED, SHARDED_ENGINE = "sharded", "sdp4bit"
SHARDED_RETIRED = ("agoq's own sharded path (--parallel sharded, SDP4Bit's sharded AdamW; plan engine sdp4bit) was "
                   "retired: FSDP2 with agoq's collectives runs faster at less memory per rank. Run --parallel fsdp "
                   "--gradients sdp4bit --weight-gather int4 --node-size 1 instead, or search a new plan with "
                   "`agoq search --layout fsdp`")

NONE, DDP, PIPELINE = "none", "ddp", "pipeline"  # the runtime's parallel modes (fsdp, hsdp: as the layouts)
PARALLEL_MODES = (NONE, DDP, FSDP, HSDP, PIPELINE)
REPLICATED_MODES = (NONE, DDP)  # every rank keeps the whole state
SHARDED_MODES = (FSDP, HSDP)  # the state is 1/N per rank (hsdp: 1/node size)
FSDP2_MODES = (FSDP, HSDP)  # PyTorch's FSDP2 shards the state: their checkpoints (DTensors) resume in each other

# the gradient storage each parallel mode runs (agoq.layout.ParallelLayout.check_gradients refuses the others)
# (hsdp: bf16 all exact; quangrad8: exact reduce-scatter in the node, QuanGrad's 8-bit all-reduce across nodes;
# sdp4bit: TLq-HS int8 in the node, TLq's 4-bit all-reduce across nodes)
MODE_GRADIENTS = {NONE: REPLICA_GRADIENT_MODES, DDP: REPLICA_GRADIENT_MODES,
                  FSDP: (BF16, SDP4BIT), HSDP: GRADIENT_MODES, PIPELINE: REPLICA_GRADIENT_MODES}
# the layout each parallel mode runs; a pipeline's stages are priced as replicated stages
PARALLEL_LAYOUT = {NONE: REPLICATED, DDP: REPLICATED, FSDP: FSDP, HSDP: HSDP, PIPELINE: REPLICATED}
# the gradient storage each layout is priced with: what its parallel mode runs
LAYOUT_GRADIENTS = {REPLICATED: MODE_GRADIENTS[DDP], FSDP: MODE_GRADIENTS[FSDP], HSDP: MODE_GRADIENTS[HSDP]}


def parallel_mode(layout: str, stages: int, processes: int) -> str:
    """The parallel mode (`agoq train --parallel`) that runs a plan of `layout` with `stages` pipeline stages over
    `processes` processes: pipeline for several stages, fsdp and hsdp for their layouts, else ddp for several
    processes and none for one."""
    if layout == SHARDED:
        raise ValueError(SHARDED_RETIRED)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if stages > 1:
        return PIPELINE
    if layout in SHARDED_MODES:
        return layout
    return DDP if processes > 1 else NONE


def search_layout(parallel: str | None) -> str | None:
    """The search's layout word of a parallel mode (None: none given, or pipeline, whose stages say it)."""
    return None if parallel in (None, PIPELINE) else PARALLEL_LAYOUT.get(parallel)


__all__ = ["GRADIENT_MODES", "REPLICA_GRADIENT_MODES", "OPTIMIZERS", "MASTERS", "COMPILE_MODES", "TORCH_COMPILE_MODES",
           "CUDA_GRAPH_MODES", "TRAIN_TORCH_COMPILE_MODES", "PLAN_TORCH_COMPILE_MODE", "LAYOUTS", "FSDP2_LAYOUTS",
           "PARALLEL_MODES",
           "REPLICATED_MODES", "SHARDED_MODES", "FSDP2_MODES", "MODE_GRADIENTS", "PARALLEL_LAYOUT", "LAYOUT_GRADIENTS",
           "parallel_mode", "search_layout", "BF16", "QUANGRAD8", "SDP4BIT", "ADAMW", "ADAMW8BIT", "EAGER",
           "COMPILED", "REPLICATED", "SHARDED", "SHARDED_ENGINE", "SHARDED_RETIRED", "FSDP", "HSDP", "NONE", "DDP", "PIPELINE", "WEIGHT_GATHERS"]
