"""--squared-relu (the ``-`` layer's option, Megatron's) trains like one process under tp, sp,
pp and dp, in the GPT model and in the Hybrid model (fp32, relative 1e-5)."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_layouts_match

LAYOUTS = [{"tp": 2}, {"tp": 2, "sequence-parallel": True}, {"pp": 2}, {"pp": 2, "vp": 2},
           {"dp": 2}]


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_gpt_with_squared_relu(pool):
    assert_layouts_match({"model": "gpt", "squared-relu": True}, layouts=LAYOUTS, pool=pool)


def test_hybrid_with_squared_relu(pool):
    flags = {"model": "hybrid", "hybrid-layer-pattern": "M-*-", "squared-relu": True,
             "mamba-state-dim": 8, "mamba-head-dim": 8, "mamba-num-groups": 2}
    assert_layouts_match(flags, layouts=[{"tp": 2}, {"pp": 2}], pool=pool)
