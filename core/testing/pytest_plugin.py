"""The kit's pytest plugin (entry point ``plugtron`` in group ``pytest11``): pools of ranks as
fixtures.

* ``rank_pool``: a :class:`~plugtron.testing.DistributedPool` of ``plugtron_ranks`` ranks
  (ini option, default 8), started once per test module and closed after it. One pool runs
  every world up to its size, so a module needs no other.
* ``rank_pool_factory``: ``rank_pool_factory(world_size, timeout=300.0)`` returns a pool of that
  size, started once per module and size.
* The largest difference each of the test's comparisons saw, passing or not, as a report
  section ("plugtron.testing differences": ``pytest -rP`` shows it for passing tests) and, with
  ``-v``, one summary at the end.

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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    from . import compare  # noqa: PLC0415 - torch only once a test runs

    compare.DIFFERENCES.clear()
    try:
        return (yield)
    finally:
        if compare.DIFFERENCES:
            text = "\n".join(map(str, compare.DIFFERENCES))
            item.add_report_section("call", "plugtron.testing differences", text)
            item.config.stash.setdefault(_SEEN, []).append((item.nodeid, text))
            compare.DIFFERENCES.clear()


_SEEN = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config) -> None:
    seen = config.stash.get(_SEEN, [])
    if seen and config.getoption("verbose") > 0:
        terminalreporter.section("plugtron.testing: largest differences")
        for nodeid, text in seen:
            terminalreporter.write_line(nodeid)
            for line in text.splitlines():
                terminalreporter.write_line(f"    {line}")
