"""Launching `agoq train` from the experiments and reading back what its run folders hold.

Runs go through `python -m agoq.train` (or `torchrun ... -m agoq.train`), the same code as `agoq train`
but without the other stages' imports, so they work on GPU images that lack pandas, optuna or ray.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BYTE_MODEL = ROOT / "experiments" / "train_llama_byte.json"
TINY_SHAKESPEARE_CANDIDATES = [ROOT.parent / "shared" / "data" / "tinyshakespeare.txt",
                               ROOT / "shared" / "data" / "tinyshakespeare.txt"]


def tiny_shakespeare(explicit: str | None) -> str:
    """The path of tinyshakespeare.txt: `explicit`, else ../shared/data or shared/data beside the repository."""
    if explicit:
        if not Path(explicit).is_file():
            raise SystemExit(f"data file not found: {explicit}")
        return explicit
    for path in TINY_SHAKESPEARE_CANDIDATES:
        if path.is_file():
            return str(path)
    raise SystemExit("tinyshakespeare.txt not found in ../shared/data or shared/data: pass --data PATH")


def launcher(nproc: int, transport: str | None = None, module: str = "agoq.train",
             node_size: int | None = None) -> list[str]:
    """The command line that runs `python -m module` in `nproc` processes (torchrun when > 1); over transport
    "nodes" each rank goes through experiments/emulated_nodes.py, in nodes of `node_size` ranks (default
    EMULATED_NODE_SIZE)."""
    if nproc <= 1:
        return [sys.executable, "-m", module]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if transport == "nodes":
        size = node_size or EMULATED_NODE_SIZE
        if nproc % size or size == nproc:
            raise SystemExit(f"--transport nodes: {nproc} processes do not make several nodes of {size}")
        return torchrun + [str(ROOT / "experiments" / "emulated_nodes.py"), "--node-size", str(size), "-m", module]
    return torchrun + ["-m", module]


def run_train(args: list[str], nproc: int = 1, env: dict | None = None, log: Path | None = None,
              transport: str | None = None) -> float:
    """Run agoq train with `args` (in `nproc` processes under torchrun when > 1, over `transport` as `launcher`
    says; eager unless `args` say --compile); returns wall seconds.

    Raises SystemExit with the command's tail of output when it fails.
    """
    if "--compile" not in args and "--no-compile" not in args:
        args = [*args, "--no-compile"]  # eager unless asked: the recorded comparisons were made eager
    cmd = launcher(nproc, transport) + list(args)
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"agoq train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    print(f"  {seconds:.0f} s", flush=True)
    return seconds


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(training step records, validation records) of a run folder's metrics.jsonl."""
    lines = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [x for x in lines if "loss" in x], [x for x in lines if "val_loss" in x]


def summarize(run_dir: str | Path, skip: int = 10) -> dict:
    """The figures of one run: final/min validation loss, last training losses, step time and throughput
    (medians over the steps after the first `skip`), peak bytes per rank (max over steps)."""
    run = json.loads(Path(run_dir, "run.json").read_text())
    steps, vals = read_metrics(run_dir)
    timed = steps[skip:] if len(steps) > skip else steps
    ranks = len(steps[0]["peak_bytes"]) if steps else 0
    return {
        "run_dir": str(Path(run_dir).resolve().relative_to(ROOT)) if Path(run_dir).resolve().is_relative_to(ROOT)
        else str(run_dir),
        "status": run["status"], "steps": run["step"], "settings": run["settings"],
        "model": {k: run["model"][k] for k in ("name", "fingerprint", "parameters")},
        "final_val_loss": vals[-1]["val_loss"] if vals else None,
        "min_val_loss": min(v["val_loss"] for v in vals) if vals else None,
        "final_train_loss_mean_last_50": statistics.fmean(s["loss"] for s in steps[-50:]) if steps else None,
        "median_step_seconds": statistics.median(s["step_seconds"] for s in timed) if timed else None,
        "median_tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed) if timed else None,
        "peak_bytes_per_rank": [max(s["peak_bytes"][r] for s in steps) for r in range(ranks)],
        "world": run["world"], "hardware": run["hardware"],
    }


def drop_checkpoint(run_dir: str | Path) -> None:
    """Remove the run's checkpoint folder (weights and optimizer state) so the folder is small enough to commit."""
    for name in ("checkpoints", "checkpoint", ".checkpoint-old"):
        path = Path(run_dir, name)
        if path.exists():
            shutil.rmtree(path)


def relative_difference(a: float, b: float) -> float:
    """|a - b| / |b|."""
    return abs(a - b) / abs(b)


# Two GPUs of one host: NVLink with NVLink multicast off, and NCCL's socket transport on loopback standing in for
# a network. agoq's one-node symmetric-memory transport ignores NCCL's variables, so the socket runs also force
# agoq's collectives onto NCCL (AGOQ_ALLREDUCE_TRANSPORT=collectives); otherwise they would measure NVLink.
NVLINK_ENV = {"NCCL_NVLS_ENABLE": "0"}
SOCKETS_ENV = {**NVLINK_ENV, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
               "NCCL_SOCKET_IFNAME": "lo", "AGOQ_ALLREDUCE_TRANSPORT": "collectives"}
# One host as nodes of EMULATED_NODE_SIZE GPUs (transport "nodes", experiments/emulated_nodes.py: one NCCL_HOSTID per
# node): NVLink inside a node, NCCL's socket transport on loopback between nodes; agoq's collectives on NCCL.
NODES_ENV = {**NVLINK_ENV, "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo", "AGOQ_ALLREDUCE_TRANSPORT": "collectives"}
EMULATED_NODE_SIZE = 2


def transport_env(transport: str) -> dict:
    """The environment of a run over `transport` (nvlink, sockets, nodes, or gloo on the CPU)."""
    return {"sockets": SOCKETS_ENV, "nvlink": NVLINK_ENV, "nodes": NODES_ENV}.get(transport, {})


def common_args(model: str, data: str, *, seq_len: int, micro_batch: int, steps: int, lr: float, eval_every: int,
                eval_batches: int, device: list[str]) -> list[str]:
    """agoq train's arguments shared by every variant of a comparison (warmup a tenth of the steps, no
    checkpoints, seed 0, quiet)."""
    return [model, "--data", data, "--seq-len", str(seq_len), "--micro-batch", str(micro_batch),
            "--steps", str(steps), "--lr", str(lr), "--warmup", str(max(1, steps // 10)),
            "--eval-every", str(eval_every), "--eval-batches", str(eval_batches), "--checkpoint-every", "0",
            "--seed", "0", "--quiet", *device]


def train_variant(common: list[str], extra: list[str], run_dir: Path, *, nproc: int, transport: str) -> dict:
    """Train one variant into a fresh `run_dir` (its checkpoints dropped); returns its summary with the wall
    seconds, the transport and its environment."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    env = transport_env(transport)
    wall = run_train(common + extra + ["--out", str(run_dir)], nproc=nproc, env=env, transport=transport)
    drop_checkpoint(run_dir)
    return {**summarize(run_dir), "wall_seconds": wall, "transport": transport, "env": env}


def compare(run: dict, base: dict, goal: float) -> dict:
    """A quantized run against its baseline: final validation losses and their relative difference (met when
    <= goal), tokens/s and their ratio, peak bytes per rank and whether the run's is not above the baseline's."""
    diff = relative_difference(run["final_val_loss"], base["final_val_loss"])
    return {"final_val_loss": [run["final_val_loss"], base["final_val_loss"]], "relative_difference": diff,
            "goal": goal, "met": diff <= goal,
            "tokens_per_s": [run["median_tokens_per_s"], base["median_tokens_per_s"]],
            "throughput_ratio": run["median_tokens_per_s"] / base["median_tokens_per_s"],
            "peak_bytes_per_rank": [run["peak_bytes_per_rank"], base["peak_bytes_per_rank"]],
            "peak_not_above_baseline": max(run["peak_bytes_per_rank"]) <= max(base["peak_bytes_per_rank"])}


def tiny_check(args, name: str) -> tuple[str, str, list[str], int, int, list[str]]:
    """The CPU check of a multi-process comparison (llama-tiny, 12 steps of 2 x 64 tokens per rank, over gloo):
    sets args.steps / seq_len / micro_batch (and args.out, when it is the committed runs folder, to a folder under
    /tmp); returns (model, result name, device flags, eval_every, eval_batches, transports)."""
    args.steps, args.seq_len, args.micro_batch = 12, 64, 2
    if args.out == str(ROOT / "experiments" / "results" / "runs"):
        args.out = "/tmp/agoq-" + name.replace("_", "-")
    return "llama-tiny", f"{name}_tiny", ["--device", "cpu"], 6, 2, ["gloo"]
