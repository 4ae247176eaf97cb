"""Fixtures the search's tests share."""

import random

import pytest

from tests.search.synthetic_profile import write_profile


@pytest.fixture
def two_rank_profile(tmp_path):
    """A synthetic profile measured on two ranks, its collectives table timing every layout's paths over a random
    link (2-20 GB/s)."""
    rng = random.Random(random.getrandbits(32))  # seeded per test: tests/conftest.py
    return write_profile(tmp_path / "profile", rng, micro_batch=2, seq_len=40, world_size=2, collectives=True,
                         fsdp_collectives=True, link_bytes_per_second=rng.uniform(2e9, 2e10))
