"""Which of a run's settings (run.json `settings`) a resumed run may change, and how a refused change is said.

A checkpoint's state depends on some settings (`FIXED_SETTINGS`: the data order, the optimizer state, the
numerics), checked against the key the checkpoint was saved with; a data file may move but not change (its
content is pinned by `data_sha256`); the pipeline's cut is checked against the checkpoint's layout. Settings
derived from others are never compared. Every other setting may change, once `--override` names it.
"""

from __future__ import annotations

# run.json settings that follow from others (never compared on resume: their sources are). grad_accum follows
# tokens_per_step and the number of data-parallel ranks, which a resume may change (the step reads the same
# sequences: agoq.train.data)
DERIVED_SETTINGS = ("min_lr", "grad_accum", "train_tokens", "val_tokens", "vocab_size", "betas", "schedule")
# settings the checkpoint's state depends on (data order, optimizer state, numerics): never changed on resume
FIXED_SETTINGS = ("seq_len", "micro_batch", "tokens_per_step", "optimizer", "master", "parallel", "gradients",
                  "policy", "dtype", "seed", "data_sha256", "tokenizer")
# settings that name a file whose content a fixed setting pins: the file may move (same content), never change
PINNED_BY_CONTENT = {"data": "data_sha256"}
# the pipeline's cut, which the checkpoint's layout fixes (check_layout)
LAYOUT_SETTINGS = ("pipeline_stages", "layer_stage")
UNCHANGEABLE = (*FIXED_SETTINGS, *PINNED_BY_CONTENT, *LAYOUT_SETTINGS, "fingerprint", "model")


def check_override(settings: dict, override: tuple[str, ...]) -> list[str]:
    """Refuse --override names that are no setting, or that cannot change on resume; returns the settings of
    `settings` that may change."""
    free = [k for k in settings if k not in DERIVED_SETTINGS and k not in UNCHANGEABLE]
    fixed = [n for n in override if n in UNCHANGEABLE]
    if fixed:
        raise ValueError(f"--override {','.join(fixed)}: the checkpoint's state depends on "
                         f"{'it' if len(fixed) == 1 else 'them'} (model, data, data order, optimizer state, numerics "
                         "or pipeline stages) and cannot change on resume: start a new run (another --out)")
    unknown = [n for n in override if n not in free]
    if unknown:
        raise ValueError(f"--override {','.join(unknown)}: not a setting a resumed run may change; those are "
                         + ", ".join(free))
    return free


def changed_settings(new: dict, old: dict, override: tuple[str, ...], out) -> dict[str, list]:
    """The settings of `new` that differ from `old` (run.json's), {name: [old, new]}, once --override allows each.

    Raises ValueError listing every change (old -> new) that --override does not name."""
    free = check_override(new, override)
    changed = {k: [old[k], new[k]] for k in free if k in old and old[k] != new[k]}
    refused = [k for k in changed if k not in override]
    if refused:
        follow = [k for k in ("warmup", "eval_every") if k in refused]
        hint = (f" ({' and '.join(follow)} default{'s' if len(follow) == 1 else ''} to a share of --steps: give "
                f"{'it' if len(follow) == 1 else 'them'} explicitly to keep the old value)") if follow else ""
        raise ValueError(f"cannot resume {out} with other settings: "
                         + ", ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused) + hint
                         + f". Add --override {','.join(refused)} to accept "
                         + ("this change" if len(refused) == 1 else "these changes")
                         + " (run.json records it), or resume with the old values")
    return changed


def difference(name: str, old, new, old_data: str | None, new_data: str) -> str:
    """'name old -> new' for a setting that differs from the checkpoint's; the data said as its files (the run's
    first and this one), with the start of their hashes."""
    if name != PINNED_BY_CONTENT["data"]:
        return f"{name} {old!r} -> {new!r}"
    hashes = f"sha256 {str(old)[:12]}... -> {str(new)[:12]}..."
    if old_data == new_data:
        return f"data {new_data} has changed since the checkpoint ({hashes})"
    return f"data {old_data or 'of the checkpoint'} -> {new_data}, another content ({hashes})"


__all__ = ["DERIVED_SETTINGS", "FIXED_SETTINGS", "PINNED_BY_CONTENT", "LAYOUT_SETTINGS", "UNCHANGEABLE",
           "check_override", "changed_settings", "difference"]


def check_layout(folder, state: dict, *, world_size: int, dims, reshardable: bool, stages: int, layer_stage) -> None:
    """Refuse (ValueError) a checkpoint (its `state`: world, dims, pipeline_stages, layer_stage) that a run of
    `world_size` processes over `dims` (agoq.parallel_dims.ParallelDims), `stages` pipeline stages and `layer_stage`
    cannot take: pipeline stages cut another way, or optimizer state kept per rank (not `reshardable`: FSDP2's 8-bit
    moments, quantized per local shard) at another world or shard size."""
    saved_world = int(state.get("world", 1))
    saved_shard = (state.get("dims") or {}).get("shard", dims.shard)
    if not reshardable and (saved_world != world_size or saved_shard != dims.shard):
        raise ValueError(f"the checkpoint in {folder} was written by {saved_world} processes sharding over "
                         f"{saved_shard} and holds optimizer state quantized per rank's shard (--parallel fsdp or "
                         f"hsdp --optimizer adamw8bit): resume it with {saved_world} processes and the same "
                         "--parallel and --node-size (the state of --optimizer adamw under FSDP2 reshards)")
    if state.get("pipeline_stages", 1) != stages or (stages > 1 and state.get("layer_stage") != layer_stage):
        raise ValueError(f"the checkpoint in {folder} was written by {state.get('pipeline_stages')} pipeline "
                         f"stages (layers per stage {state.get('layer_stage')}), this run has {stages} "
                         f"({layer_stage}): a pipeline resumes with the same stages (same number of processes and "
                         "plan)")
