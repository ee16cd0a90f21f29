"""MoE layers under context parallelism train like one process: each cp rank routes its chunks of
every sequence, the balancing statistics (aux_loss, seq_aux_loss, global_aux_loss) are summed
over cp, and each rank's share of a loss term is added over cp with its gradient; z-loss is the
mean over the whole microbatch. cp 2 alone and cp 2 x ep 2 (experts split over the cp ranks)
with each dispatcher; the GPT model's E and the Hybrid model's. fp32, relative 1e-5 on losses
(every balancing loss) and grad norms. One pool of 2 ranks for the module."""

from __future__ import annotations

import pytest
from plugtron.testing import assert_records_close, train_run
from plugtron.testing.config import merge_flags

MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 0.01,
       "moe-z-loss-coeff": 0.001, "position-embedding-type": "rope", "train-iters": 3}
KEYS = ("lm_loss", "grad_norm", "load_balancing_loss", "z_loss")
LAYOUTS = [{"cp": 2}, {"cp": 2, "expert-model-parallel-size": 2},
           {"cp": 2, "expert-model-parallel-size": 2, "moe-token-dispatcher-type": "alltoall",
            "cp-comm-type": "a2a"}]


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def check(flags: dict, pool, keys=KEYS) -> None:
    want = train_run(flags, world_size=1, pool=pool).records
    assert all(key in want[0] for key in keys), (keys, want[0])
    for layout in LAYOUTS:
        got = train_run(merge_flags(flags, layout), pool=pool).records
        assert_records_close(got, want, 1e-5, f"{layout} vs one process", keys=keys)


def test_aux_loss_and_z_loss_under_cp(pool):
    check(MOE, pool)


def test_the_hybrid_models_moe_layers_under_cp(pool):
    """E by symbol in a Hybrid pattern (attention and MoE only: Mamba refuses cp)."""
    check(merge_flags(MOE, {"model": "hybrid", "hybrid-layer-pattern": "*E*E"}), pool)


def test_seq_and_global_aux_losses_with_a_shared_expert_under_cp(pool):
    flags = merge_flags(MOE, {
        "moe-router-load-balancing-type": ["seq_aux_loss", "global_aux_loss"],
        "moe-aux-loss-coeff": [0.01, 0.001], "moe-shared-expert-intermediate-size": 16})
    check(flags, pool, ("lm_loss", "grad_norm", "seq_load_balancing_loss",
                        "global_load_balancing_loss"))
