"""Resharding across real layouts (4 ranks): save at iteration 5 under tp 2 x pp 2, resume under
tp 1 x pp 1 (dp 4), tp 4, pp 2 x vp 2 (dp 2) and pp 2 under zbv's V (dp 2); losses 6..10 equal the uninterrupted
single-process run within relative 1e-5. The distributed optimizer's state moves the same way.

Each case skips while its layout is not available in this branch (tensor parallelism in the
``local`` backend, the pipeline schedules, the distributed optimizer); after those branches
merge, the cases run.
"""

from __future__ import annotations

import os

import pytest
from plugtron.api import selected_driver
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.parallel.context import ParallelContext
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import resolve_schedule

from .helpers import ckpt_config, train_resumable

WORLD = 4
LATER = range(6, 11)
REL = 1e-5
MODEL = {"num_layers": 4, "num_attention_heads": 8, "num_query_groups": 4, "swiglu": True}
SAVED = {"tp": 2, "pp": 2}
TARGETS = {"tp1-pp1-dp4": {}, "tp4": {"tp": 4}, "pp2-vp2-dp2": {"pp": 2, "vp": 2},
           "pp2-zbv-dp2": {"pp": 2, "schedule": "zbv"}}


def missing(layout: dict) -> str | None:
    """Why ``layout`` cannot run in this branch (None when it can)."""
    config = ckpt_config(**MODEL, **layout)
    tp = layout.get("tp", 1)
    if tp > 1:
        ctx = ParallelContext.build(WORLD, 0, tp=tp, create_groups=False)
        try:
            registry.load("layer_backend", selected_driver(config, "layer_backend"))(config, ctx)
        except (ConfigError, PluginError) as exc:
            return f"tp {tp}: {exc}"
    names = {info.name for info in registry.available("schedule")}
    schedule = resolve_schedule(config)
    if schedule not in names:
        return f"schedule {schedule!r} is not installed yet"
    optimizers = {i.name for i in registry.available("optimizer")}
    if layout.get("use_distributed_optimizer") and "distributed-adam" not in optimizers:
        return "distributed optimizer not installed yet"
    return None


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(WORLD)


@pytest.fixture(scope="module")
def reference():
    return train_resumable(ckpt_config(**MODEL), single_process())[0]


def _train(rank, world_size, stop_at=None, **settings):
    return train_resumable(ckpt_config(**MODEL, **settings), stop_at=stop_at)[0]


def _last_stage(per_rank: list[dict]) -> dict:
    """Losses are reduced to every rank; take any rank that reported them."""
    return next(r for r in per_rank if r)


@pytest.fixture(scope="module")
def saved_tp2_pp2(request, tmp_path_factory):
    why = missing(SAVED)
    if why:
        pytest.skip(why)
    pool = request.getfixturevalue("pool")
    save = str(tmp_path_factory.mktemp("tp2pp2"))
    losses = _last_stage(pool.run(_train, stop_at=5, save=save, **SAVED))
    return save, losses


def _check(losses: dict, reference: dict) -> None:
    assert sorted(losses) == list(LATER)
    for i in LATER:
        assert abs(losses[i] - reference[i]) <= REL * abs(reference[i]), (i, losses, reference)


@pytest.mark.parametrize("target", list(TARGETS), ids=list(TARGETS))
def test_reshard_tp2_pp2_into(target, saved_tp2_pp2, request):
    why = missing(TARGETS[target])
    if why:
        pytest.skip(why)
    reference = request.getfixturevalue("reference")
    save, first = saved_tp2_pp2
    for i in range(1, 6):
        assert abs(first[i] - reference[i]) <= REL * abs(reference[i])
    pool = request.getfixturevalue("pool")
    resumed = pool.run(_train, load=os.path.join(save, "iter_0000005"), **TARGETS[target])
    _check(_last_stage(resumed), reference)


def test_distributed_optimizer_reshards(request, tmp_path):
    """Distributed-optimizer state saved under dp 4 resumes under tp 2 x pp 2 and back."""
    source, target = {"use_distributed_optimizer": True}, {**SAVED,
                                                            "use_distributed_optimizer": True}
    for layout in (source, target):
        why = missing(layout)
        if why:
            pytest.skip(why)
    reference = request.getfixturevalue("reference")
    pool = request.getfixturevalue("pool")
    pool.run(_train, stop_at=5, save=str(tmp_path / "a"), **source)
    _check(_last_stage(pool.run(_train, load=str(tmp_path / "a"), **target)), reference)
    pool.run(_train, stop_at=5, save=str(tmp_path / "b"), **target)
    _check(_last_stage(pool.run(_train, load=str(tmp_path / "b"), **source)), reference)


def _evaluate(rank, world_size, load, **settings):
    from plugtron.core.tools.evaluate import evaluate_checkpoint

    return evaluate_checkpoint(ckpt_config(**MODEL, load=load, eval_iters=2, **settings))


def test_evaluate_under_tp2_pp2(saved_tp2_pp2, request):
    """The tp 2 x pp 2 checkpoint evaluated in one process and under tp 2 x pp 2."""
    from plugtron.core.tools.evaluate import evaluate_checkpoint

    save, _ = saved_tp2_pp2
    alone = evaluate_checkpoint(ckpt_config(**MODEL, load=save, eval_iters=2),
                                world=single_process())
    pool = request.getfixturevalue("pool")
    losses = pool.run(_evaluate, load=save, **SAVED)
    assert all(loss == pytest.approx(alone, rel=1e-5) for loss in losses)
