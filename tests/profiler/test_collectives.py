"""Collective timings over gloo with 2 and 3 processes: every (op, path) at every size, same on all ranks."""

import pytest

from tests.multiprocess import run_workers


def _profile(rank, world, sizes):
    from agoq.profiler.collectives import profile_collectives

    return profile_collectives(sizes, iters=2)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_table(world):
    sizes = [9 << 10, 100 << 10]  # bytes of fp32, not powers of two
    results = run_workers(_profile, world, sizes)
    rows, failures = results[0]
    assert failures == []
    expected = {("all_reduce", "nccl-fp32"), ("all_reduce", "nccl-bf16"), ("all_reduce", "quangrad8"),
                ("reduce_scatter", "nccl-fp32"), ("reduce_scatter", "nccl-bf16"), ("reduce_scatter", "sdp4bit"),
                ("all_gather", "nccl-fp32"), ("all_gather", "nccl-bf16"), ("all_gather", "sdp4bit")}
    for size in sizes:
        got = {(r["op"], r["path"]) for r in rows if r["message_bytes"] == (size // 4) * 4}
        assert got == expected, size
    assert all(r["world_size"] == world and r["seconds"] > 0 and r["backend"] == "gloo" for r in rows)
    # the slowest rank's median is agreed on: every rank reports the same figures
    for other in results[1:]:
        assert [r["seconds"] for r in other[0]] == [r["seconds"] for r in rows]
