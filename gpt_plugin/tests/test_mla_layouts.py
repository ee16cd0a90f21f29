"""Multi-latent attention (issue 27) and YaRN rope train like one process: tp 2 (the shared rotary key's
gradient summed over tp), tp 2 with sequence parallelism (replicated down-projections fed this
rank's tokens), pp 2, and cp 2 over each path (p2p and all-gather with the narrower values
padded to the key size, a2a as they are); with query compression, values narrower than the
keys. fp32, dropout 0, relative 1e-5 on losses and grad norms. One spawn of 2 ranks for the
module."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_layouts_match

FLAGS = {"model": "gpt", "multi-latent-attention": True, "q-lora-rank": 12, "kv-lora-rank": 8,
         "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 5,
         "position-embedding-type": "rope", "normalization": "RMSNorm", "swiglu": True,
         "add-bias-linear": False, "num-layers": 2}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_tensor_sequence_and_pipeline_parallel_match_one_process(pool):
    assert_layouts_match(FLAGS, layouts=[{"tp": 2}, {"tp": 2, "sequence-parallel": True},
                                         {"pp": 2}], pool=pool)


def test_every_context_parallel_path_matches_one_process(pool):
    assert_layouts_match(FLAGS, layouts=[{"cp": 2}, {"cp": 2, "cp-comm-type": "allgather"},
                                         {"cp": 2, "cp-comm-type": "a2a"}], pool=pool)


def test_without_query_compression_under_tp_and_sp(pool):
    flags = {k: v for k, v in FLAGS.items() if k != "q-lora-rank"}
    assert_layouts_match(flags, layouts=[{"tp": 2, "sequence-parallel": True}], pool=pool)


YARN = {"rope-type": "yarn", "rotary-scaling-factor": 40.0, "mscale": 0.707,
        "mscale-all-dim": 0.707, "yarn-original-max-position-embeddings": 8}


def test_yarn_matches_one_process(pool):
    """MLA with DeepSeek-V2's YaRN (cos/sin and softmax corrections) under tp 2 + sp and cp 2,
    the standard attention with Qwen's (mscale on cos and sin) under tp 2 and cp 2."""
    assert_layouts_match({**FLAGS, **YARN},
                         layouts=[{"tp": 2, "sequence-parallel": True}, {"cp": 2}], pool=pool)
    standard = {"model": "gpt", "position-embedding-type": "rope", "normalization": "RMSNorm",
                "rope-type": "yarn", "rotary-scaling-factor": 4.0,
                "yarn-original-max-position-embeddings": 8, "num-layers": 2}
    assert_layouts_match(standard, layouts=[{"tp": 2}, {"cp": 2}], pool=pool)
