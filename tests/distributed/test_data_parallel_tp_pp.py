"""tp 2 x pp 2 x dp 2 (world 8) with the distributed optimizer (and overlap, interleaving,
sequence parallelism) against the single-process run.

Needs a tensor-parallel layer backend and a pipeline schedule; skipped where this tree has
neither (they are built in other branches and meet this one at the merge).
"""

import pytest
from plugtron.api import selected_driver
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins import registry

from tests.distributed.dp_helpers import losses, max_rel_diff, one_thread, pool_train, train_run
from tests.utils import tiny_config

LAYOUT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
          "train_iters": 5, "num_layers": 4}
TOL = 1e-4  # fp32, relative, over 5 iterations (the bound for this layout)


def _missing() -> str | None:
    if "1f1b" not in {info.name for info in registry.available("schedule")}:
        return "no '1f1b' pipeline schedule installed"
    config = tiny_config(**LAYOUT)
    parallel = ParallelContext.build(8, 0, tp=2, pp=2, create_groups=False)
    try:
        registry.load("layer_backend", selected_driver(config, "layer_backend"))(config, parallel)
    except (ConfigError, PluginError) as exc:
        return f"layer backend without tensor parallelism: {exc}"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(8, timeout=600)


@pytest.fixture(scope="module")
def reference():
    records, _, _ = train_run({"train_iters": 5, "num_layers": 4}, world=single_process())
    return losses(records), [r["grad_norm"] for r in records]


OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True}
VARIANTS = {
    "distributed": {"use_distributed_optimizer": True},
    "distributed+overlap": {"use_distributed_optimizer": True, **OVERLAP},
    "distributed+overlap+vp2+sp": {"use_distributed_optimizer": True, **OVERLAP,
                                   "virtual_pipeline_model_parallel_size": 2,
                                   "sequence_parallel": True},
    "adam+overlap+vp2": {"overlap_grad_reduce": True,
                         "virtual_pipeline_model_parallel_size": 2},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_pp2_dp2_matches_one_rank(pool, reference, variant):
    for result in pool.run(pool_train, {**LAYOUT, **VARIANTS[variant]}):
        assert max_rel_diff(result["losses"], reference[0]) < TOL
        # The norm spans tp, pp and the optimizer shards, each element once.
        assert max_rel_diff(result["grad_norm"], reference[1]) < TOL
