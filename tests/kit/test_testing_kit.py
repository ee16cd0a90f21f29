"""The built-in plugins pass the conformance kit (plugtron.testing) that third parties use, and
the kit's checks can fail.

One pool of 8 ranks (the kit's own ``rank_pool`` fixture, which pytest loads through the
``pytest11`` entry point) runs every check; the kit re-forms its world for each layout's size.
Tolerances are the kit's defaults, stated in each function's docstring.
"""

from __future__ import annotations

import pytest
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.pipeline.executor import ActionListSchedule
from plugtron.core.pipeline.plan import Action
from plugtron.testing import (
    assert_checkpoint_reshards,
    assert_layouts_match,
    assert_optimizer_dp_equivalent,
    assert_params_close,
    assert_schedule_matches_1f1b,
    make_config,
    train_run,
    world_size_of,
)
from plugtron.testing.compare import assert_copies_match

from tests.schedule_helpers import RandomOrderSchedule

GPT = {"model": "gpt", "num-layers": 4}
UNTIED = {**GPT, "untie-embeddings-and-output-weights": True}


class MismatchedOrders(ActionListSchedule):
    """Each list is valid alone, together they deadlock: rank 0 runs each microbatch's backward
    right after its forward while the last rank runs every forward first, so rank 0 waits for
    a gradient the last rank computes only after a forward that rank 0 never sends."""

    @hookimpl
    def schedule_actions(self, pp_rank, pp_size, num_microbatches):
        if pp_rank == 0:
            return [a for mb in range(num_microbatches) for a in (Action("F", mb),
                                                                  Action("B", mb))]
        return ([Action("F", mb) for mb in range(num_microbatches)]
                + [Action("B", mb) for mb in range(num_microbatches)])


def test_pytest_loads_the_kit_through_its_entry_point(request):
    plugin = request.config.pluginmanager.get_plugin("plugtron")
    assert plugin is not None and plugin.__name__ == "plugtron.testing.pytest_plugin"


def test_make_config_reads_flags_in_any_spelling():
    config = make_config({"--num-layers": 6, "hidden_size": 64, "tp": 2, "dp": 2,
                          "untie-embeddings-and-output-weights": True})
    assert config.model.num_layers == 6 and config.model.hidden_size == 64
    assert config.parallel.tensor_model_parallel_size == 2
    assert config.model.untie_embeddings_and_output_weights
    assert config.plugins.data == "mock" and config.model.hidden_dropout == 0.0
    assert world_size_of({"tp": 2, "pipeline-model-parallel-size": 2, "dp": 2}) == 8
    assert world_size_of({"pp": 2, "vp": 2}) == 2


def _world(rank, world_size):
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def test_pool_runs_every_world_up_to_its_size(rank_pool):
    assert rank_pool.run(_world, world_size=2) == [2, 2]
    assert rank_pool.run(_world, world_size=1) == [1]
    assert rank_pool.run(_world) == [8] * 8


def _what_a_rank_sees(rank, world_size):
    import os
    import sys

    return os.environ.get("PLUGTRON_POOL_PROBE"), sys.path[0], os.getcwd()


def test_a_new_pool_sees_the_parents_environment_path_and_directory(tmp_path, monkeypatch):
    """Ranks are forked from a server that started earlier, with the environment of then: a
    pool started now still hands each rank the parent's environment, sys.path and working
    directory of now, as spawning did."""
    from plugtron.testing.pool import DistributedPool

    with DistributedPool(1, timeout=120) as pool:  # the fork server runs from here on
        pool.run(_what_a_rank_sees)
    monkeypatch.setenv("PLUGTRON_POOL_PROBE", "now")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with DistributedPool(2, timeout=120) as pool:
        seen = pool.run(_what_a_rank_sees)
    assert seen == [("now", str(tmp_path), str(tmp_path))] * 2


def _mark_cache(rank, world_size):
    from plugtron.testing.pool import worker_cache

    worker_cache()["mark"] = rank


def _cache_marked(rank, world_size):
    from plugtron.testing.pool import worker_cache

    return worker_cache().get("mark") == rank


def test_a_refreshed_pool_has_a_new_world_and_an_empty_cache(rank_pool):
    """``refresh()``: the next run re-forms the world and empties every rank's cache, as a
    new pool would, keeping the processes."""
    rank_pool.run(_mark_cache)
    assert rank_pool.run(_cache_marked) == [True] * 8
    rank_pool.refresh()
    assert rank_pool.run(_cache_marked) == [False] * 8
    assert rank_pool.run(_world) == [8] * 8


@pytest.mark.parametrize("flags", [GPT, UNTIED], ids=["tied", "untied"])
def test_gpt_matches_one_process_under_every_default_layout(rank_pool, flags):
    assert_layouts_match(flags, pool=rank_pool)


def test_a_layout_that_changes_the_run_fails(rank_pool):
    # A different learning rate leaves iteration 1 equal and moves iteration 2: the check
    # compares every iteration, and names the layout.
    with pytest.raises(AssertionError, match=r"tp2-lr0.002 against one process: lm_loss at "
                                             r"iteration 2"):
        assert_layouts_match(GPT, layouts=[{"tp": 2, "lr": 2e-3}], pool=rank_pool)


@pytest.mark.parametrize("schedule,vp", [("gpipe", None), ("interleaved-1f1b", None),
                                         ("gpipe", 2), ("interleaved-1f1b", 2)])
def test_built_in_schedules_match_1f1b(rank_pool, schedule, vp):
    assert_schedule_matches_1f1b(schedule, pp=2, vp=vp, flags=GPT, pool=rank_pool)


def test_a_schedule_object_matches_interleaved_1f1b(rank_pool):
    assert_schedule_matches_1f1b(RandomOrderSchedule(seed=3), pp=2, vp=2, flags=GPT,
                                 pool=rank_pool)


def test_a_deadlocking_schedule_is_rejected_before_any_rank_runs():
    # No pool: the lists are played in this process and rejected before a run would start.
    with pytest.raises(AssertionError, match="wait on each other forever"):
        assert_schedule_matches_1f1b(MismatchedOrders(), pp=2, microbatches=4, flags=GPT)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "distributed-adam"])
def test_built_in_optimizers_step_the_same_on_dp2(rank_pool, optimizer):
    assert_optimizer_dp_equivalent(optimizer, flags=GPT, dp=2, pool=rank_pool)


def test_a_layer_wise_optimizer_steps_the_same_on_dp2(rank_pool):
    # muon's sharded mode (whole matrices per rank), its Newton-Schulz iteration in fp32
    assert_optimizer_dp_equivalent("muon", dp=2, pool=rank_pool, flags={
        **GPT, "use-distributed-optimizer": True, "muon-fp32-matmul-prec": "high"})


@pytest.mark.parametrize("save,load", [({"tp": 2}, {"pp": 2}),
                                       ({"tp": 2, "pp": 2, "dp": 2}, {"pp": 2, "vp": 2})],
                         ids=["tp2-to-pp2", "tp2pp2dp2-to-pp2vp2"])
def test_checkpoints_reshard_between_layouts(rank_pool, save, load):
    assert_checkpoint_reshards(GPT, save, load, pool=rank_pool)


def test_a_resume_under_other_settings_fails(rank_pool):
    with pytest.raises(AssertionError, match="resumed pp2-lr0.01 from tp2 at 2"):
        assert_checkpoint_reshards(GPT, {"tp": 2}, {"pp": 2, "lr": 1e-2}, pool=rank_pool)


def test_train_run_gathers_full_parameters(rank_pool):
    one = train_run(GPT, 1, rank_pool, gather_params=True)
    split = train_run({**GPT, "tp": 2, "pp": 2}, 4, rank_pool, gather_params=True)
    assert "embedding.word_embeddings.weight@copy" in split.params  # the last stage's tied copy
    # Full tensors under one name each, equal to one process's (atol as for optimizers).
    assert_params_close(assert_copies_match(split.params, 1e-5, 1e-5, "tp2-pp2"), one.params,
                        1e-5, 1e-5, "tp2-pp2 against one process")
