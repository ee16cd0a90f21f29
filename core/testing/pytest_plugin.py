"""The kit's pytest plugin (entry point ``plugtron`` in group ``pytest11``): pools of ranks as
fixtures.

* ``rank_pool``: a :class:`~plugtron.testing.DistributedPool` of ``plugtron_ranks`` ranks
  (ini option, default 8), started once per test module and closed after it. One pool runs
  every world up to its size, so a module needs no other.
* ``rank_pool_factory``: ``rank_pool_factory(world_size, timeout=300.0)`` returns a pool of that
  size for this module.

Both share one set of processes for the whole session (spawning ranks and importing torch in
each costs seconds per module): the session's pool grows to the largest size asked for, a
module gets a view of its size, and every module starts on a re-formed world with an empty
``worker_cache``, as with a pool of its own.

Nothing here imports torch until a fixture is used.
"""

from __future__ import annotations

import pytest

DEFAULT_RANKS = 8


def pytest_addoption(parser) -> None:
    parser.addini("plugtron_ranks", f"Ranks of the rank_pool fixture (default {DEFAULT_RANKS}).",
                  default=str(DEFAULT_RANKS))


class PoolView:
    """``world_size`` ranks of the session's pool: ``run`` defaults to this size and timeout."""

    def __init__(self, session, world_size: int, timeout: float):
        self.session, self.world_size, self.timeout = session, world_size, timeout

    def run(self, fn, *args, world_size: int | None = None, timeout: float | None = None,
            **kwargs) -> list:
        size = self.world_size if world_size is None else world_size
        if size > self.world_size:
            raise ValueError(f"world_size {size} does not fit a pool of {self.world_size}")
        pool = self.session.get(self.world_size)
        return pool.run(fn, *args, world_size=size, timeout=timeout or self.timeout, **kwargs)


class _SessionPool:
    def __init__(self):
        self.pool = None

    def get(self, world_size: int):
        from .pool import DistributedPool

        if self.pool is None or self.pool.world_size < world_size:
            self.close()
            self.pool = DistributedPool(world_size)
        self.pool.start()
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


@pytest.fixture(scope="session")
def _plugtron_session_pool():
    pools = _SessionPool()
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def rank_pool_factory(_plugtron_session_pool):
    """``get(world_size, timeout=300.0)`` -> ``world_size`` started ranks for this module."""
    used = []

    def get(world_size: int, timeout: float = 300.0) -> PoolView:
        pool = _plugtron_session_pool.get(world_size)
        if not used:
            pool.refresh()  # this module starts on a new world and an empty worker cache
            used.append(pool)
        return PoolView(_plugtron_session_pool, world_size, timeout)

    yield get


@pytest.fixture(scope="module")
def rank_pool(request, rank_pool_factory):
    """A pool of ``plugtron_ranks`` ranks (default 8) for this module's checks."""
    return rank_pool_factory(int(request.config.getini("plugtron_ranks")))
