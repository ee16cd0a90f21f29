"""The layouts combined on 8 ranks (issue 27): a tiny DeepSeek-V3-shaped model (multi-latent
attention with query compression, a dense layer then an MoE layer with a shared expert, sigmoid
routing with expert bias and seq_aux_loss, one MTP layer, itself MoE) trains like one process
under tp 2 + sp x pp 2 x ep 2 x dp 2 with the distributed optimizer, with each dispatcher, and
under cp 2 x tp 2 + sp x pp 2 with ep 2 over the cp ranks. fp32, relative 1e-5 on every loss
(lm, mtp_1, the balancing loss) and the grad norm. One pool of 8 ranks for the module."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_layouts_match

FLAGS = {"num-layers": 2, "moe-layer-freq": "([0]*1+[1]*1)", "num-experts": 4,
         "moe-router-topk": 2, "moe-router-score-function": "sigmoid",
         "moe-router-enable-expert-bias": True, "moe-shared-expert-intermediate-size": 16,
         "moe-ffn-hidden-size": 16, "moe-router-load-balancing-type": "seq_aux_loss",
         "moe-aux-loss-coeff": 0.001, "mtp-num-layers": 1, "mtp-loss-scaling-factor": 0.3,
         "swiglu": True, "normalization": "RMSNorm", "add-bias-linear": False,
         "position-embedding-type": "rope", "multi-latent-attention": True,
         "q-lora-rank": 12, "kv-lora-rank": 8, "qk-head-dim": 6, "qk-pos-emb-head-dim": 4,
         "v-head-dim": 5}
TP_PP_EP_DP = {"tp": 2, "sequence-parallel": True, "pp": 2, "expert-model-parallel-size": 2,
               "dp": 2, "use-distributed-optimizer": True}
LAYOUTS = {
    "tp2-sp-pp2-ep2-dp2-distopt-alltoall": {**TP_PP_EP_DP,
                                            "moe-token-dispatcher-type": "alltoall"},
    "tp2-sp-pp2-ep2-dp2-distopt-allgather": {**TP_PP_EP_DP,
                                             "moe-token-dispatcher-type": "allgather"},
    "cp2-tp2-sp-pp2-ep2": {"cp": 2, "tp": 2, "sequence-parallel": True, "pp": 2,
                           "expert-model-parallel-size": 2},
}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(8)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_combined_layout_trains_like_one_process(name, pool):
    assert_layouts_match(FLAGS, layouts=[LAYOUTS[name]], pool=pool)
