"""The kit refuses a layout the CLI refuses before launch, before it starts any rank: the test
gets the ConfigError, not a traceback from every rank."""

from __future__ import annotations

import pytest
from plugtron.core.errors import ConfigError
from plugtron.testing import assert_layouts_match, pool, train_losses


@pytest.fixture()
def no_ranks(monkeypatch):
    def refuse(self):
        raise AssertionError("a rank was started for a layout the CLI refuses")

    monkeypatch.setattr(pool.DistributedPool, "start", refuse)


def test_train_losses_refuses_before_starting_ranks(no_ranks):
    with pytest.raises(ConfigError, match="not divisible by --expert-model-parallel-size 2"):
        train_losses({"num-experts": 3, "ep": 2}, world_size=2)


def test_assert_layouts_match_refuses_before_starting_ranks(no_ranks):
    with pytest.raises(ConfigError, match="--num-attention-heads 3"):
        assert_layouts_match({"num-attention-heads": 3, "hidden-size": 48}, layouts=[{"tp": 2}])
