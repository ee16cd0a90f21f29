"""A third party's non-element-wise optimizer, the layer-wise example of
docs/plugins/optimizers.md (installed from the page), passes the kit's optimizer check in its
sharded mode (``--use-distributed-optimizer``: whole parameters per data-parallel rank), as
``muon`` does; and ``plugtron estimate`` counts the state it keeps on its fullest rank."""

from __future__ import annotations

import pathlib
import re

import pytest
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.training.loop import setup, train
from plugtron.testing import assert_optimizer_dp_equivalent, make_config

from tests.fake_plugins import fake_distribution

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "plugins" / "optimizers.md"
EXAMPLE = re.compile(r"<!-- example: plugtron_normalized.py -->\n```python\n(.*?)```", re.S)
FLAGS = {"optimizer": "normalized-momentum", "use-distributed-optimizer": True, "lr": 1e-3}


@pytest.fixture(scope="module")
def normalized(tmp_path_factory):
    source, = EXAMPLE.findall(PAGE.read_text())
    with fake_distribution(tmp_path_factory.mktemp("normalized"), "plugtron-normalized",
                           "plugtron.optimizers",
                           "normalized-momentum=plugtron_normalized:NormalizedMomentumPlugin",
                           "plugtron_normalized", source):
        yield


@pytest.fixture(scope="module")
def pool(normalized, rank_pool_factory):
    return rank_pool_factory(2)


def test_the_layer_wise_mode_steps_like_dp1(pool):
    assert_optimizer_dp_equivalent("normalized-momentum", flags=FLAGS, dp=2, pool=pool)


def _state_bytes(rank, world_size, flags):
    config = make_config(flags)
    run = setup(config)
    train(run, MetricsLogger(config, rank=1))
    return run.optimizer.state_bytes()


def test_the_estimate_counts_the_state_it_keeps(pool):
    from plugtron.core.tools.estimate import estimate_memory

    flags = {**FLAGS, "train-iters": 1}
    measured = pool.run(_state_bytes, flags, world_size=2)
    estimate, = estimate_memory(make_config(flags), 2).ranks
    assert estimate.optimizer_selected == max(measured), (estimate.optimizer_selected, measured)
