"""LoRA passes the kit's transform check: tp 2 (adapters split to match column- and
row-parallel bases), tp 2 with sequence parallelism, pp 2 and dp 2 with the distributed
optimizer train like one process (relative 1e-5 on losses and grad norms over 3 iterations);
the merged plain model computes the LoRA model's logits (1e-5); a checkpoint round trip resumes
bitwise. So do pp 2 x vp 2, cp 2, fsdp2, full recompute at tp 2, zb-h1 and zbv. With a fused [gate; up] fc1 (SwiGLU), dropout 0, fp32; and the adapters trained under
tp 2 with sequence parallelism equal one process's within 1e-5, canonical LoRA's
per-projection adapters (q, k, v; gate, up) included. One pool of 2 ranks."""

from __future__ import annotations

import pytest
from plugtron.testing import (
    assert_layouts_match,
    assert_records_close,
    assert_transform_conforms,
    train_run,
)

from tests.distributed.dp_helpers import max_param_diff

FLAGS = {"model": "gpt", "lora-rank": 4, "lora-alpha": 8.0, "swiglu": True,
         "num-layers": 2}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def test_lora_passes_the_transform_check(pool):
    assert_transform_conforms(FLAGS, pool=pool)


def test_the_adapters_trained_under_tp_and_sp_are_those_of_one_process(pool):
    one = train_run(FLAGS, 1, pool, gather_params=True).params
    split = train_run({**FLAGS, "tp": 2, "sequence-parallel": True}, 2, pool,
                      gather_params=True).params
    assert one is not None and split is not None
    adapters = {name for name in one if ".adapter." in name}
    assert len(adapters) == 2 * 4 * 2  # 2 layers x 4 linears x (A, B)
    assert max_param_diff({n: split[n] for n in adapters}, {n: one[n] for n in adapters}) < 1e-5
    assert max_param_diff(split, one) < 1e-5


def test_lora_under_the_other_layouts_matches_one_process(pool):
    """Interleaving, context parallelism, fsdp2 (the frozen base sharded, no gradient for it),
    full recompute under tp 2, and the split-backward schedules (the adapters' weight gradients
    deferred to W): one reference, each layout named when it differs."""
    assert_layouts_match({**FLAGS, "num-layers": 4}, pool=pool, layouts=[
        {"pp": 2, "vp": 2}, {"cp": 2}, {"dp": 2, "use-torch-fsdp2": True},
        {"tp": 2, "recompute-granularity": "full", "recompute-method": "uniform",
         "recompute-num-layers": 1},
        {"pp": 2, "schedule": "zb-h1"}, {"pp": 2, "schedule": "zbv"}])


CANONICAL = {**FLAGS, "num-query-groups": 2,
             "lora-target-modules": "linear_q,linear_k,linear_v,linear_proj,linear_fc1_gate,"
                                    "linear_fc1_up,linear_fc2"}


def test_canonical_lora_under_tp_and_sp_trains_like_one_process(pool):
    """Per-projection adapters of q, k, v (per query group under tp, as linear_qkv's shard
    holds them) and of gate, up: losses, grad norms and the trained adapters equal one
    process's (relative 1e-5 / 1e-5 absolute)."""
    one = train_run(CANONICAL, 1, pool, gather_params=True)
    split = train_run({**CANONICAL, "tp": 2, "sequence-parallel": True}, 2, pool,
                      gather_params=True)
    assert_records_close(split.records, one.records, 1e-5, "tp 2 sp against one process")
    assert one.params is not None and split.params is not None
    adapters = {name for name in one.params if ".adapter." in name}
    assert len(adapters) == 2 * (3 + 1 + 2 + 1) * 2  # 2 layers x 7 projections x (A, B)
    assert max_param_diff({n: split.params[n] for n in adapters},
                          {n: one.params[n] for n in adapters}) < 1e-5


MLA = {"model": "gpt", "multi-latent-attention": True, "q-lora-rank": 12, "kv-lora-rank": 8,
       "qk-head-dim": 6, "qk-pos-emb-head-dim": 4, "v-head-dim": 5,
       "position-embedding-type": "rope", "normalization": "RMSNorm", "swiglu": True,
       "add-bias-linear": False, "num-layers": 2, "lora-rank": 4,
       "lora-target-modules": "linear_q_up_proj,linear_kv_up_proj,linear_proj,linear_fc1,"
                              "linear_fc2"}


def test_lora_on_mla_projections_matches_one_process(pool):
    """MLA's up-projections are column-parallel linears of the backend like any other."""
    assert_layouts_match(MLA, layouts=[{"tp": 2, "sequence-parallel": True}], pool=pool)
