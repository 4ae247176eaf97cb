"""Spreading sensitivity measurements over a Ray cluster: one task per chunk of measurements.

Each task builds the model from its spec and seed (identical weights everywhere) and measures its
chunk against its own reference; a task asks for one GPU when the profile runs on CUDA. The workers of
a cluster must have agoq installed (and a `package.module:function` model importable).
"""

from __future__ import annotations


def ray_measure(job: dict, chunks: list[list[dict]], address: str | None, progress=None) -> list[dict]:
    """Run `chunk_task(job, chunk)` for every chunk as Ray tasks; `address` None starts a local Ray.

    Returns the results of all chunks, in chunk order. Raises ValueError if Ray is missing or cannot
    connect.
    """
    import os
    from pathlib import Path

    try:
        import ray
    except ImportError:
        raise ValueError("--ray / --ray-address need the ray package (pip install ray)") from None
    from agoq.profiler.sensitivity import chunk_task

    try:
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False)
            else:  # a local Ray: its workers import agoq from where this process does
                root = str(Path(__file__).resolve().parents[2])
                path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
                ray.init(include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": path}})
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"cannot start or reach Ray at {address or 'a new local instance'}: {e}") from None
    options = {"num_gpus": 1} if job["device"].startswith("cuda") else {"num_cpus": 1}
    task = ray.remote(**options)(chunk_task)
    refs = [task.remote(job, chunk) for chunk in chunks]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[list[dict] | None] = [None] * len(refs)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a lost task is recorded for each of its measurements
                results[i] = [{**m, "error": f"ray task failed: {type(e).__name__}: {e}"[:500]} for m in chunks[i]]
            if progress is not None:
                progress(len(chunks[i]))
    return [row for chunk in results for row in chunk]
