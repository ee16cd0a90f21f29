"""The split backward on gloo ranks: ``zb-h1`` and a third-party schedule that defers every
weight gradient train exactly like ``1f1b`` (one pool of 4 ranks for the module; fp32, no
dropout; losses and grad norms relative 1e-5)."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_schedule_matches_1f1b
from plugtron.testing.compare import assert_records_close
from plugtron.testing.runs import train_run

from tests.schedule_helpers import DeferredWeightsSchedule, VShapeGPipe

GPT = {"model": "gpt", "num-layers": 4}
#: What a schedule needs beyond the layout 1f1b runs (the looped zero-bubble one: chunks).
OWN_FLAGS = {"interleaved-zero-bubble": {"vp": 2}}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8)])
def test_zb_h1_and_h2_match_1f1b(pool, schedule, pp, microbatches):
    assert_schedule_matches_1f1b(schedule, pp=pp, microbatches=microbatches, flags=GPT,
                                 rtol=1e-5, pool=pool)


def _compare(flags, schedule, pool, world_size=4):
    base = {**GPT, "train-iters": 3, **flags}
    own = {"schedule": schedule, **OWN_FLAGS.get(schedule, {})} if isinstance(schedule,
                                                                               str) else {}
    got = train_run({**base, **own}, world_size, pool,
                    schedule=None if isinstance(schedule, str) else schedule)
    key = (repr(sorted(base.items())), world_size)
    if key not in _REFERENCE:  # the same 1f1b run serves every schedule of a layout
        _REFERENCE[key] = train_run({**base, "schedule": "1f1b"}, world_size, pool).records
    assert_records_close(got.records, _REFERENCE[key], 1e-5, f"{schedule} against 1f1b {flags}")


#: 1f1b's records per (flags, world size), within this module.
_REFERENCE: dict = {}


def test_zb_h1_matches_1f1b_under_tp_2_and_sequence_parallel(pool):
    # the column/row linears go through sequence_parallel_linear's deferred weight gradient
    _compare({"pp": 2, "tp": 2, "sequence-parallel": True, "global-batch-size": 8}, "zb-h1",
             pool)


def test_zbv_with_the_fused_output_loss_matches_1f1b(pool):
    # the output layer's weight gradient, recomputed from the chunks' logits at W; the V
    # shape puts the loss on rank 0, the one that also holds the tied embedding
    _compare({"pp": 2, "cross-entropy-loss-fusion": True, "global-batch-size": 8}, "zbv",
             pool)


def test_weights_deferred_past_other_backwards_match_1f1b_with_overlapped_dp_reduce(pool):
    # dp 2 with --overlap-grad-reduce and small buckets: a bucket is reduced only after the
    # last W of its weights, which here runs after every I
    _compare({"pp": 2, "overlap-grad-reduce": True, "ddp-bucket-size": 4096,
              "global-batch-size": 8}, DeferredWeightsSchedule(), pool)


def test_a_third_party_split_schedule_matches_1f1b(pool):
    assert_schedule_matches_1f1b(DeferredWeightsSchedule(), pp=4, microbatches=6, flags=GPT,
                                 rtol=1e-5, pool=pool)


def test_zb_h1_matches_1f1b_with_full_recompute(pool):
    # the recomputed forward runs inside I and must build the same (deferrable) graph
    _compare({"pp": 2, "recompute-granularity": "full", "recompute-method": "uniform",
              "recompute-num-layers": 1, "global-batch-size": 8}, "zb-h1", pool, world_size=2)


def test_zb_h1_matches_1f1b_with_selective_recompute(pool):
    _compare({"pp": 2, "recompute-granularity": "selective", "global-batch-size": 8}, "zb-h1",
             pool, world_size=2)


def test_zb_h1_matches_1f1b_with_the_distributed_optimizer_and_overlap(pool):
    # dp 2, sharded gradient buckets reduced (reduce-scatter) as their last W finishes, and
    # the parameter all-gather overlapped with the next forward
    _compare({"pp": 2, "use-distributed-optimizer": True, "overlap-grad-reduce": True,
              "overlap-param-gather": True, "ddp-bucket-size": 4096,
              "global-batch-size": 8}, "zb-h1", pool)


def test_zb_h1_matches_1f1b_with_moe_experts_on_ep_2(pool):
    # the MoE plugin's experts go through plugtron.api.linear (deferred) or grouped matmuls
    # (computed at I); either way the result must not change
    pytest.importorskip("plugtron_moe")
    _compare({"pp": 2, "ep": 2, "num-experts": 4, "moe-router-topk": 2,
              "moe-aux-loss-coeff": 1e-2, "moe-shared-expert-intermediate-size": 32,
              "global-batch-size": 8}, "zb-h1", pool)


def test_zb_h1_matches_1f1b_for_the_hybrid_model(pool):
    # Mamba-2 layers: their projections are linears (deferred), the convolution falls back
    _compare({"model": "hybrid", "hybrid-layer-pattern": "M*M-", "mamba-state-dim": 8,
              "mamba-head-dim": 8, "mamba-num-groups": 2, "pp": 2, "global-batch-size": 8},
             "zb-h1", pool, world_size=2)


def test_zb_h1_matches_1f1b_with_context_parallel_2(pool):
    _compare({"pp": 2, "cp": 2, "seq-length": 16, "max-position-embeddings": 16,
              "global-batch-size": 8}, "zb-h1", pool)


# ---------------------------------------------------------------- the V and the looped family


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8)])
def test_v_shape_schedules_match_1f1b(pool, schedule, pp, microbatches):
    # rank 0 holds the first and the last stage (the tied embedding's two copies on one rank,
    # summed locally); the last rank hands its chunk-0 output to its chunk 1 without a message
    assert_schedule_matches_1f1b(schedule, pp=pp, microbatches=microbatches,
                                 flags={**GPT, "num-layers": 2 * pp}, rtol=1e-5, pool=pool)


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8)])
def test_interleaved_zero_bubble_matches_interleaved_1f1b(pool, pp, microbatches):
    assert_schedule_matches_1f1b("interleaved-zero-bubble", pp=pp, vp=2,
                                 microbatches=microbatches, flags={**GPT, "num-layers": 2 * pp},
                                 rtol=1e-5, pool=pool)


def test_a_third_party_v_shape_schedule_matches_1f1b(pool):
    # it declares the placement through the optional hook, from plugtron.api alone
    assert_schedule_matches_1f1b(VShapeGPipe(), pp=2, microbatches=4,
                                 flags={**GPT, "num-layers": 4}, rtol=1e-5, pool=pool)


def test_zbv_matches_1f1b_for_moe_on_ep_2_with_grouped_experts(pool):
    # the grouped experts' batched matmuls defer through their stacked weights, the router's
    # linear through its cast to fp32
    pytest.importorskip("plugtron_moe")
    _compare({"pp": 2, "ep": 2, "num-experts": 4, "moe-router-topk": 2,
              "moe-aux-loss-coeff": 1e-2, "moe-grouped-gemm": True, "moe-router-dtype": "fp32",
              "global-batch-size": 8}, "zbv", pool)


def test_dualpipev_matches_1f1b_for_the_hybrid_model(pool):
    _compare({"model": "hybrid", "hybrid-layer-pattern": "M*M-", "mamba-state-dim": 8,
              "mamba-head-dim": 8, "mamba-num-groups": 2, "pp": 2, "global-batch-size": 8},
             "dualpipev", pool, world_size=2)


def test_zbv_matches_1f1b_under_tp_2_sequence_parallel_and_distributed_optimizer(pool):
    _compare({"pp": 2, "tp": 2, "sequence-parallel": True, "global-batch-size": 8}, "zbv",
             pool)
    _compare({"pp": 2, "use-distributed-optimizer": True, "overlap-grad-reduce": True,
              "ddp-bucket-size": 4096, "global-batch-size": 8}, "zbv", pool)


def test_zbv_matches_1f1b_with_recompute_and_context_parallel(pool):
    _compare({"pp": 2, "recompute-granularity": "full", "recompute-method": "uniform",
              "recompute-num-layers": 1, "global-batch-size": 8}, "zbv", pool, world_size=2)
    _compare({"pp": 2, "cp": 2, "seq-length": 16, "max-position-embeddings": 16,
              "global-batch-size": 8}, "zbv", pool)


# ---------------------------------------------------------------- checkpoints


DROPOUT = {**GPT, "pp": 2, "global-batch-size": 8, "hidden-dropout": 0.1,
           "attention-dropout": 0.1, "train-iters": 4}


@pytest.mark.parametrize("schedule, extra", [("zbv", {}), ("dualpipev", {}), ("zb-h1", {}),
                                             ("zb-h2", {}),
                                             ("interleaved-zero-bubble", {"vp": 2})])
def test_dropout_runs_resume_bitwise(pool, tmp_path, schedule, extra):
    flags = {**DROPOUT, "schedule": schedule, **extra}
    whole = train_run(flags, 2, pool)
    train_run({**flags, "save": str(tmp_path)}, 2, pool, stop_at=2)
    resumed = train_run({**flags, "load": str(tmp_path)}, 2, pool)
    for key in ("lm_loss", "grad_norm"):
        assert resumed.series(key) == whole.series(key)[2:], key


def test_a_v_shape_checkpoint_resumes_under_1f1b_and_back(pool, tmp_path):
    # checkpoints are layout-free: the V's chunks store the model's own (global) names
    flags = {**GPT, "pp": 2, "global-batch-size": 8, "train-iters": 4}
    whole = train_run({**flags, "schedule": "1f1b"}, 2, pool)
    for saved, resumed_under in (("zbv", "1f1b"), ("1f1b", "dualpipev")):
        path = tmp_path / saved
        train_run({**flags, "schedule": saved, "save": str(path)}, 2, pool, stop_at=2)
        resumed = train_run({**flags, "schedule": resumed_under, "load": str(path)}, 2, pool)
        assert_records_close(resumed.records, whole.records[2:], 1e-5,
                             f"saved under {saved}, resumed under {resumed_under}")



# ---------------------------------------------------------------- every new schedule x layout

NEW = ["zb-h2", "interleaved-zero-bubble", "zbv", "dualpipev"]
LAYOUTS = {
    "tp2-sp": ({"pp": 2, "tp": 2, "sequence-parallel": True, "global-batch-size": 8}, 4),
    "dp2-distopt-overlap": ({"pp": 2, "use-distributed-optimizer": True,
                             "overlap-grad-reduce": True, "ddp-bucket-size": 4096,
                             "global-batch-size": 16}, 4),
    "recompute": ({"pp": 2, "recompute-granularity": "full", "recompute-method": "uniform",
                   "recompute-num-layers": 1, "global-batch-size": 8}, 2),
    "cp2": ({"pp": 2, "cp": 2, "seq-length": 16, "max-position-embeddings": 16,
             "global-batch-size": 8}, 4),
    "moe-ep2": ({"pp": 2, "ep": 2, "num-experts": 4, "moe-router-topk": 2,
                 "moe-aux-loss-coeff": 1e-2, "moe-grouped-gemm": True,
                 "global-batch-size": 16}, 4),
    "mla-mtp": ({"multi-latent-attention": True, "q-lora-rank": 12, "kv-lora-rank": 8,
                 "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 5,
                 "position-embedding-type": "rope", "normalization": "RMSNorm",
                 "mtp-num-layers": 1, "pp": 2, "global-batch-size": 8}, 2),
    "hybrid": ({"model": "hybrid", "hybrid-layer-pattern": "M*M-", "mamba-state-dim": 8,
                "mamba-head-dim": 8, "mamba-num-groups": 2, "pp": 2, "global-batch-size": 8},
               2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("schedule", NEW)
def test_every_new_schedule_matches_1f1b_under_each_layout(pool, schedule, layout):
    if layout == "moe-ep2":
        pytest.importorskip("plugtron_moe")
    flags, world_size = LAYOUTS[layout]
    _compare(flags, schedule, pool, world_size=world_size)


# ---------------------------------------------------------------- pp 4 with MoE and Hybrid


@pytest.fixture(scope="module")
def pool8(rank_pool_factory):
    return rank_pool_factory(8)


def test_moe_on_ep_2_at_pp_4(pool8):
    pytest.importorskip("plugtron_moe")
    _compare({"pp": 4, "ep": 2, "num-layers": 8, "num-experts": 4, "moe-router-topk": 2,
              "moe-aux-loss-coeff": 1e-2, "global-batch-size": 16}, "zbv", pool8, world_size=8)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_hybrid_at_pp_4(pool, schedule):
    # dualpipev needs 2 x pp = 8 microbatches
    _compare({"model": "hybrid", "hybrid-layer-pattern": "M*M-M*M-", "mamba-state-dim": 8,
              "mamba-head-dim": 8, "mamba-num-groups": 2, "pp": 4, "micro-batch-size": 1,
              "global-batch-size": 8}, schedule, pool, world_size=4)
