"""Data-parallel checkpoints (2 ranks): bitwise resume under the same layout, and resume
under another dp size (and optimizer) within relative 1e-5 of the uninterrupted run."""

from __future__ import annotations

import os

import pytest
from plugtron.core.parallel.distributed import single_process
from plugtron.core.plugins import registry

from .helpers import ckpt_config, train_resumable

LATER = range(6, 11)
REL = 1e-5


def has_optimizer(name: str) -> bool:
    return any(info.name == name for info in registry.available("optimizer"))


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(2)


def _train(rank, world_size, stop_at=None, single=False, **settings):
    """One run on the pool's world (dp 2), or in rank 0 alone (dp 1) with ``single``."""
    if single and rank != 0:
        return None
    world = single_process() if single else None
    return train_resumable(ckpt_config(**settings), world, stop_at=stop_at)[0]


def _close(a: dict, b: dict) -> bool:
    return all(abs(a[i] - b[i]) <= REL * abs(b[i]) for i in LATER)


@pytest.fixture(scope="module")
def uninterrupted(pool, tmp_path_factory):
    """dp 2, 10 iterations, saving every 5."""
    save = str(tmp_path_factory.mktemp("dp2"))
    losses = pool.run(_train, save=save, save_interval=5)
    assert losses[0] == losses[1]
    return save, losses[0]


def test_dp2_resume_is_bitwise(pool, uninterrupted):
    save, losses = uninterrupted
    resumed = pool.run(_train, load=os.path.join(save, "iter_0000005"))
    assert [resumed[0][i] for i in LATER] == [losses[i] for i in LATER]


def test_dp2_checkpoint_resumes_in_one_process(pool, uninterrupted):
    save, losses = uninterrupted
    resumed = pool.run(_train, single=True, load=os.path.join(save, "iter_0000005"))[0]
    assert sorted(resumed) == list(LATER) and _close(resumed, losses), (resumed, losses)


def test_dp1_checkpoint_resumes_on_dp2(pool, uninterrupted, tmp_path):
    _, losses = uninterrupted
    pool.run(_train, single=True, stop_at=5, save=str(tmp_path))
    resumed = pool.run(_train, load=str(tmp_path))[0]
    assert sorted(resumed) == list(LATER) and _close(resumed, losses), (resumed, losses)


@pytest.mark.skipif(not has_optimizer("distributed-adam"),
                    reason="distributed optimizer not installed in this branch yet")
def test_distributed_optimizer_resume(pool, uninterrupted, tmp_path):
    _, losses = uninterrupted
    dist = {"use_distributed_optimizer": True}
    full = pool.run(_train, save=str(tmp_path), save_interval=5, **dist)[0]
    assert _close(full, losses)
    resumed = pool.run(_train, load=str(tmp_path / "iter_0000005"), **dist)[0]
    assert [resumed[i] for i in LATER] == [full[i] for i in LATER]  # same layout: bitwise
    # its state loads into a plain Adam in one process, and back
    plain = pool.run(_train, single=True, load=str(tmp_path / "iter_0000005"))[0]
    assert _close(plain, full)
    pool.run(_train, single=True, stop_at=5, save=str(tmp_path / "plain"))
    back = pool.run(_train, load=str(tmp_path / "plain"), **dist)[0]
    assert _close(back, full)


def _evaluate(rank, world_size, load, single=False, **settings):
    from plugtron.core.tools.evaluate import evaluate_checkpoint

    if single and rank != 0:
        return None
    config = ckpt_config(load=load, eval_iters=2, **settings)
    return evaluate_checkpoint(config, world=single_process() if single else None)


def test_evaluate_in_another_layout(pool, uninterrupted):
    save, _ = uninterrupted
    on_dp2 = pool.run(_evaluate, load=save)
    alone = pool.run(_evaluate, load=save, single=True)[0]
    assert on_dp2[0] == on_dp2[1] == pytest.approx(alone, rel=1e-6)
