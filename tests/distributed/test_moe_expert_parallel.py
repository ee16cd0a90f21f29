"""Expert parallelism against one process (fp32, dropout 0): every layout trains the same
losses, grad norms and aux losses; checkpoints move between expert-parallel sizes.

Tolerance: relative 1e-5 per iteration (observed ~1e-7: only summation order differs).
One pool of 8 gloo ranks for the module (the kit's ``rank_pool`` fixture).
"""

from __future__ import annotations

import pytest
from plugtron.testing import assert_checkpoint_reshards, assert_records_close, train_run
from plugtron.testing.config import merge_flags

RTOL = 1e-5
KEYS = ("lm_loss", "grad_norm", "load_balancing_loss", "z_loss")
MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 0.01,
       "moe-z-loss-coeff": 0.001, "train-iters": 3}


def ep(size: int, **more) -> dict:
    """A layout with expert parallelism: ep borrows from dp, so dp (the kit's world key) is
    given explicitly; ``more`` adds tp/pp/dp factors of the decoder grid."""
    dp = more.pop("dp", size)
    return {"expert-model-parallel-size": size, "dp": dp, **more}


def check(flags: dict, layout: dict, pool, keys=KEYS) -> list[dict]:
    want = train_run(flags, world_size=1, pool=pool).records
    got = train_run(merge_flags(flags, layout), pool=pool).records
    assert_records_close(got, want, RTOL, f"{layout} vs one process", keys=keys)
    return got


LAYOUTS = {
    "ep2": ep(2),
    "ep4-alltoall": {**ep(4), "moe-token-dispatcher-type": "alltoall"},
    "tp2-ep2": ep(2, tp=2),
    "tp2-sp-ep2-alltoall": {**ep(2, tp=2), "sequence-parallel": True,
                            "moe-token-dispatcher-type": "alltoall"},
    "pp2-ep2": ep(2, pp=2),
    "pp2-vp2-ep2": {**ep(2, pp=2), "virtual-pipeline-model-parallel-size": 2},
    "ep2-dp2-distributed-optimizer": {**ep(2, dp=4), "use-distributed-optimizer": True},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(name, rank_pool):
    check(MOE, LAYOUTS[name], rank_pool)


#: Expert tensor parallelism other than tp (etp regroups tp x dp: with tp 2 and etp 1 the tp
#: ranks hold other experts, or replicas over edp). grad_norm checks that the norm counts every
#: expert element once (a tp-sum of expert norms at etp 1 would double them). (num_zeros is
#: not compared: a few fp32 gradients cancel to exactly 0 in some summation orders, etp = tp too.)
ETP_LAYOUTS = {
    "tp2-ep2-etp1-sp-alltoall": {**ep(2, tp=2), "expert-tensor-parallel-size": 1,
                                 "sequence-parallel": True,
                                 "moe-token-dispatcher-type": "alltoall"},
    "tp2-ep2-etp1-allgather": {**ep(2, tp=2), "expert-tensor-parallel-size": 1},
    "tp2-etp1-distributed-optimizer": {"tp": 2, "expert-tensor-parallel-size": 1,
                                       "use-distributed-optimizer": True},
    "dp2-etp2-alltoall": {"dp": 2, "expert-tensor-parallel-size": 2,
                          "moe-token-dispatcher-type": "alltoall"},
}


def test_expert_tensor_parallel_trains_like_one_process(rank_pool):
    want = train_run(MOE, world_size=1, pool=rank_pool).records
    for name, layout in ETP_LAYOUTS.items():
        got = train_run(merge_flags(MOE, layout), pool=rank_pool).records
        assert_records_close(got, want, RTOL, f"{name} vs one process", keys=KEYS)


@pytest.mark.parametrize("load", [{"tp": 2}, {}], ids=["tp2-etp2", "tp1"])
def test_checkpoint_saved_at_etp1_resumes_at_other_etp(load, rank_pool):
    save = {**ep(2, tp=2), "expert-tensor-parallel-size": 1, "sequence-parallel": True}
    assert_checkpoint_reshards(MOE, save_layout=save, load_layout=load, pool=rank_pool)


def test_allgather_equals_alltoall_and_grouped_equals_looped(rank_pool):
    runs = {}
    for dispatcher in ("allgather", "alltoall"):
        for grouped in (False, True):
            flags = merge_flags(MOE, ep(2), {"moe-token-dispatcher-type": dispatcher,
                                             "moe-grouped-gemm": grouped})
            runs[dispatcher, grouped] = train_run(flags, pool=rank_pool).records
    want = runs["allgather", False]
    for key, got in runs.items():
        assert_records_close(got, want, RTOL, f"{key} vs allgather looped", keys=KEYS)


def test_capacity_dropping_drops_what_one_process_drops(rank_pool):
    """With a capacity factor below what routing needs, tokens are dropped: the losses differ
    from the dropless run's and equal one process's (the same tokens were dropped)."""
    capped = merge_flags(MOE, {"moe-expert-capacity-factor": 0.5})
    dropless = train_run(MOE, world_size=1, pool=rank_pool).records
    for layout in (ep(2), {**ep(4), "moe-token-dispatcher-type": "alltoall",
                           "moe-pad-expert-input-to-capacity": True}):
        got = check(capped, layout, rank_pool)
        assert abs(got[0]["lm_loss"] - dropless[0]["lm_loss"]) > 1e-5


def test_expert_bias_balancing_with_ep_and_dp(rank_pool):
    """Aux-loss-free balancing: the bias update sums tokens per expert over tp x dp, so it is
    the same as one process's and the runs stay equal."""
    flags = merge_flags(MOE, {"moe-router-score-function": "sigmoid",
                              "moe-router-enable-expert-bias": True,
                              "moe-router-bias-update-rate": 0.05, "moe-aux-loss-coeff": 0,
                              "train-iters": 4})
    check(flags, {**ep(2, dp=4), "moe-token-dispatcher-type": "alltoall"}, rank_pool,
          keys=("lm_loss", "grad_norm"))


@pytest.mark.parametrize("load", [{}, ep(4)], ids=["ep1", "ep4"])
def test_checkpoint_saved_at_ep2_resumes_at_other_ep(load, rank_pool):
    assert_checkpoint_reshards(MOE, save_layout=ep(2), load_layout=load, pool=rank_pool)


def test_checkpoint_moves_with_distributed_optimizer(rank_pool):
    flags = merge_flags(MOE, {"use-distributed-optimizer": True})
    assert_checkpoint_reshards(flags, save_layout=ep(2, dp=4), load_layout=ep(4),
                               pool=rank_pool)
