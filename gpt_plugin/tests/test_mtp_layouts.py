"""Multi-token prediction (issue 27) trains like one process: tp 2, tp 2 with sequence parallelism,
pp 2 (the MTP layers on the last stage, the word embeddings there the tied output layer, or a
copy shared with the first stage when untied), pp 2 x vp 2, zbv's V-shape placement, cp 2 over
each --cp-comm-type (the shift crosses the cp ranks' chunks); and an MoE model whose MTP layer
is an MoE layer under ep 2, tp 2 + sp and cp 2. Losses (lm loss, every mtp_k loss, the
balancing loss) and grad norms within relative 1e-5, fp32. One pool of 2 ranks for the
module."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_checkpoint_reshards, assert_layouts_match

FLAGS = {"model": "gpt", "mtp-num-layers": 2, "mtp-loss-scaling-factor": 0.3,
         "position-embedding-type": "rope", "normalization": "RMSNorm", "swiglu": True,
         "add-bias-linear": False}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_tensor_sequence_and_pipeline_parallel_match_one_process(pool):
    assert_layouts_match(FLAGS, layouts=[{"tp": 2}, {"tp": 2, "sequence-parallel": True}, {"pp": 2},
                                         {"pp": 2, "vp": 2}], pool=pool)


def test_every_context_parallel_path_matches_one_process(pool):
    """The shifted tokens, labels and mask cross the cp ranks' chunks (depth 2 reaches two
    places into the next chunk); each mtp_k loss is the whole microbatch's."""
    assert_layouts_match(FLAGS, layouts=[{"cp": 2}, {"cp": 2, "cp-comm-type": "allgather"},
                                         {"cp": 2, "cp-comm-type": "a2a"}], pool=pool)


def test_masked_tokens_split_unevenly_over_cp(pool):
    """--eod-mask-loss masks the documents' ends, so the cp ranks hold different numbers of
    counted tokens (add_loss weights each by its own): each depth's mean is still the whole
    microbatch's, and its gradient one process's (a per-rank mean would move the grad norm by
    ~1e-3). With --reset-position-ids (packed documents' positions; their attention masks are
    refused under cp) the depths' rotary positions are the unshifted tokens', as on one
    process."""
    flags = {**FLAGS, "eod-mask-loss": True, "reset-position-ids": True, "seq-length": 32,
             "mtp-loss-scaling-factor": 1.0}
    assert_layouts_match(flags, layouts=[{"cp": 2}], pool=pool)


def test_untied_embeddings_under_pipeline_parallel(pool):
    flags = {**FLAGS, "untie-embeddings-and-output-weights": True}
    assert_layouts_match(flags, layouts=[{"pp": 2}, {"pp": 2, "schedule": "zbv"}], pool=pool)


def test_v_shape_placement_puts_the_mtp_layers_on_rank_0(pool):
    """zbv: the last chunk (output layer, MTP) is rank 0's second; its embedding copy is summed
    with the first chunk's on the same rank."""
    assert_layouts_match(FLAGS, layouts=[{"pp": 2, "schedule": "zbv"}], pool=pool)


DEEPSEEK = {**FLAGS, "mtp-num-layers": 1, "num-experts": 4, "moe-router-topk": 2,
            "moe-layer-freq": "([0]*2+[1]*2)", "moe-aux-loss-coeff": 0.01,
            "multi-latent-attention": True, "q-lora-rank": 12, "kv-lora-rank": 8,
            "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 5}


def test_deepseek_shaped_model_with_an_moe_mtp_layer_under_ep(pool):
    assert_layouts_match(DEEPSEEK, layouts=[{"expert-model-parallel-size": 2, "dp": 2},
                                            {"tp": 2, "sequence-parallel": True}], pool=pool)


def test_deepseek_shaped_model_under_cp(pool):
    """MLA, MoE (the MTP layer too) and MTP under cp 2: the ring and all-gather with MLA's
    padded values, and a2a with the experts split over the cp ranks."""
    assert_layouts_match(DEEPSEEK, layouts=[
        {"cp": 2}, {"cp": 2, "cp-comm-type": "allgather"},
        {"cp": 2, "cp-comm-type": "a2a", "expert-model-parallel-size": 2,
         "moe-token-dispatcher-type": "alltoall"}], pool=pool)


def test_checkpoint_saved_at_pp_2_resumes_on_one_process_and_back(pool):
    """The MTP layers and the last stage's shared embedding copy are saved once, under their
    names, and resharded like every other layer."""
    from plugtron.core.checkpoint import CheckpointReader

    def has_mtp_once(directory):
        names = set(CheckpointReader(directory).tensors)
        assert "model/mtp.layers.1.eh_proj.weight" in names
        assert not any("mtp_embedding" in name for name in names)  # stored as the embedding

    flags = {**FLAGS, "untie-embeddings-and-output-weights": True}
    assert_checkpoint_reshards(flags, save_layout={"pp": 2}, load_layout={}, pool=pool,
                               inspect=has_mtp_once)
    assert_checkpoint_reshards(flags, save_layout={}, load_layout={"tp": 2}, pool=pool)
