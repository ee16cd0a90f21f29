"""The architecture options of the downloaded families (issue 15) train like one process under
tp 2, tp 2 with sequence parallelism, pp 2, pp 2 with vp 2 and dp 2 with the distributed
optimizer, all on in one model: --openai-gelu, a sliding window shorter than the sequence,
q/k/v-only biases, per-head q/k norms, Llama 3.x rope scaling and partial rotary (half of each
head turned, --rotary-percent 0.5); and under cp 2 all but the
window (a window shorter than the sequence is refused with cp > 1 before launch:
gpt_plugin/tests/test_architecture_options.py). fp32, dropout 0, relative 1e-5 on losses and grad norms.
One spawn for the module."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_layouts_match

FLAGS = {"model": "gpt", "openai-gelu": True, "window-size": "5,0", "add-bias-linear": False,
         "add-qkv-bias": True, "qk-layernorm": True, "normalization": "RMSNorm",
         "num-query-groups": 2, "position-embedding-type": "rope", "use-rope-scaling": True,
         "rope-scaling-factor": 4.0, "rope-scaling-original-max-position-embeddings": 8,
         "rotary-percent": 0.5}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_all_architecture_options_match_one_process(pool):
    assert_layouts_match(FLAGS, layouts=[{"tp": 2}, {"tp": 2, "sequence-parallel": True},
                                         {"pp": 2}, {"pp": 2, "vp": 2},
                                         {"dp": 2, "use-distributed-optimizer": True}],
                         pool=pool)


def test_options_but_the_window_match_one_process_under_cp(pool):
    flags = {k: v for k, v in FLAGS.items() if k != "window-size"}
    assert_layouts_match(flags, layouts=[{"cp": 2}], pool=pool)
