"""LoRA trains like one process under every layout it shards for: tp 2 (adapters split to
match column- and row-parallel bases), tp 2 with sequence parallelism, pp 2, and dp 2 with the
distributed optimizer; with a fused [gate; up] fc1 (SwiGLU) and dropout 0, fp32: relative 1e-5
on losses and grad norms over 3 iterations (the kit's check), and the trained adapters equal
one process's within 1e-5 under tp 2 with sequence parallelism. One pool of 2 ranks."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_layouts_match, train_run

from tests.distributed.dp_helpers import max_param_diff

FLAGS = {"model": "gpt", "lora-rank": 4, "lora-alpha": 8.0, "swiglu": True,
         "num-layers": 2}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_lora_layouts_match_one_process(pool):
    assert_layouts_match(FLAGS, layouts=[{"tp": 2}, {"tp": 2, "sequence-parallel": True},
                                         {"pp": 2},
                                         {"dp": 2, "use-distributed-optimizer": True}],
                         pool=pool)


def test_the_adapters_trained_under_tp_and_sp_are_those_of_one_process(pool):
    one = train_run(FLAGS, 1, pool, gather_params=True).params
    split = train_run({**FLAGS, "tp": 2, "sequence-parallel": True}, 2, pool,
                      gather_params=True).params
    assert one is not None and split is not None
    adapters = {name for name in one if ".adapter." in name}
    assert len(adapters) == 2 * 4 * 2  # 2 layers x 4 linears x (A, B)
    assert max_param_diff({n: split[n] for n in adapters}, {n: one[n] for n in adapters}) < 1e-5
    assert max_param_diff(split, one) < 1e-5
