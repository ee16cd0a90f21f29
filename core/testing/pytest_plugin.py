"""The kit's pytest plugin (entry point ``plugtron`` in group ``pytest11``): pools of ranks as
fixtures.

* ``rank_pool``: a :class:`~plugtron.testing.DistributedPool` of ``plugtron_ranks`` ranks
  (ini option, default 8), started once per test module and closed after it. One pool runs
  every world up to its size, so a module needs no other.
* ``rank_pool_factory``: ``rank_pool_factory(world_size, timeout=300.0)`` returns a pool of that
  size, started once per module and size.

Nothing here imports torch until a fixture is used.
"""

from __future__ import annotations

import pytest

DEFAULT_RANKS = 8


def pytest_addoption(parser) -> None:
    parser.addini("plugtron_ranks", f"Ranks of the rank_pool fixture (default {DEFAULT_RANKS}).",
                  default=str(DEFAULT_RANKS))


@pytest.fixture(scope="module")
def rank_pool_factory():
    """``get(world_size, timeout=300.0)`` -> a started pool, one per size in this module."""
    from .pool import DistributedPool  # noqa: PLC0415 - a pytest11 plugin loads in every pytest session: torch only when a test asks for a pool
    pools: dict = {}

    def get(world_size: int, timeout: float = 300.0) -> DistributedPool:
        if world_size not in pools:
            pools[world_size] = DistributedPool(world_size, timeout=timeout)
            pools[world_size].start()
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def rank_pool(request, rank_pool_factory):
    """A pool of ``plugtron_ranks`` ranks (default 8) for this module's checks."""
    return rank_pool_factory(int(request.config.getini("plugtron_ranks")))
