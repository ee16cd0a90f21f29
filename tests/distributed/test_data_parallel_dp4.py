"""Data parallelism over 4 gloo ranks (one pool for the module) against the single-process run
with the same global batch (one microbatch per rank), on data with uneven loss masks; and the
distributed optimizer's memory: each rank keeps state for its quarter only."""

import pytest
from plugtron.core.parallel.distributed import single_process

from tests.distributed.dp_helpers import (
    VARIANTS,
    losses,
    max_param_diff,
    max_rel_diff,
    one_thread,
    pool_train,
    train_run,
)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

TOL = 1e-5  # fp32



@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4, timeout=300)


@pytest.fixture(scope="module")
def reference():
    records, params, run = train_run({}, world=single_process())
    return losses(records), params, run.optimizer.state_bytes()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dp4_matches_one_rank(pool, reference, variant):
    results = pool.run(pool_train, VARIANTS[variant])
    for result in results:
        assert max_rel_diff(result["losses"], reference[0]) < TOL
        assert max_param_diff(result["params"], reference[1]) < TOL
    for result in results[1:]:
        assert max_param_diff(result["params"], results[0]["params"]) == 0.0


def test_distributed_optimizer_state_is_split_over_the_ranks(pool, reference):
    results = pool.run(pool_train, {"use_distributed_optimizer": True}, stop_after=1)
    per_rank = [r["state_bytes"] for r in results]
    # Each real element's two fp32 moments live on exactly one rank ...
    assert sum(per_rank) == reference[2]
    # ... and no rank holds more than its shard of every (padded) bucket.
    for result in results:
        assert 0 < result["state_bytes"] <= 2 * 4 * result["shard_capacity"]
    assert max(per_rank) < reference[2] / 4 * 1.5
