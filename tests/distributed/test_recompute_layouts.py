"""Recompute under tp with sp, pp with vp, cp and expert parallelism: bitwise the same layout's
run without it, dropout on (every random stream is replayed)."""

from __future__ import annotations

import importlib.util

import pytest
from plugtron.testing import train_run

BASE = {"num-layers": 4, "hidden-dropout": 0.1, "attention-dropout": 0.0, "train-iters": 2}
LAYOUTS = {
    "tp 2 sp": {"tp": 2, "sequence-parallel": True, "attention-dropout": 0.1},
    "pp 2 vp 2": {"pp": 2, "vp": 2},
    "cp 2": {"cp": 2, "seq-length": 16, "max-position-embeddings": 16},
    "ep 2": {"num-experts": 4, "ep": 2, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2,
             "moe-shared-expert-intermediate-size": 32},
    # counts that change between microbatches: the rerun must use the first run's
    "ep 2 global aux, expert bias": {
        "num-experts": 4, "ep": 2, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2,
        "moe-router-load-balancing-type": "global_aux_loss",
        "moe-router-enable-expert-bias": True, "moe-router-score-function": "sigmoid",
        "micro-batch-size": 1, "global-batch-size": 4},
}
MODES = [{"recompute-granularity": "full"},
         {"recompute-granularity": "selective", "recompute-modules": ["core_attn,mlp"]}]
#: The MoE layer's own parts, on the layouts with experts.
MOE_MODES = [{"recompute-granularity": "selective",
              "recompute-modules": ["layernorm,moe_act,shared_experts"]},
             {"recompute-granularity": "selective", "recompute-modules": ["moe"]}]


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_recompute_matches_the_layout_without_it(pool, layout):
    if "num-experts" in LAYOUTS[layout] and importlib.util.find_spec("plugtron_moe") is None:
        pytest.skip("plugtron-moe is not installed")
    flags = {**BASE, **LAYOUTS[layout]}
    want = train_run(flags, 2, pool).records
    for mode in MODES + (MOE_MODES if "num-experts" in flags else []):
        got = train_run({**flags, **mode}, 2, pool).records
        for key in ("lm_loss", "grad_norm"):
            assert [r[key] for r in got] == [r[key] for r in want], (layout, mode, key)
