"""Checkpoints move between cp sizes: cp holds no weights of its own, but the iteration, data
position, optimizer state and RNG state must carry over (cp 2 -> cp 1 and cp 1 -> cp 2)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from plugtron.core import checkpoint
from plugtron.core.checkpoint.layout import iteration_dirname
from plugtron.core.checkpoint.reader import CheckpointReader
from plugtron.core.training import loop as training
from plugtron.testing import assert_checkpoint_reshards, make_config, train_run

GPT = {"model": "gpt", "position-embedding-type": "rope"}


@pytest.fixture(scope="module")
def pool(rank_pool_factory):
    return rank_pool_factory(4, timeout=300)


@pytest.mark.parametrize("save,load", [({"cp": 2}, {}), ({}, {"cp": 2}),
                                       ({"cp": 2, "dp": 2}, {"cp": 4})])
def test_resume_across_cp_sizes(pool, save, load):
    assert_checkpoint_reshards(GPT, save_layout=save, load_layout=load, pool=pool)


def _rng_after_load(rank, world_size, flags):
    run = training.setup(make_config(flags))
    try:
        checkpoint.load_if_requested(run)
        return (torch.get_rng_state(), run.backend.rng_tracker.get_state(),
                run.state.consumed_samples)
    finally:
        checkpoint.close(run)


@pytest.mark.parametrize("save_cp,load_cp", [(2, 1), (1, 2)])
def test_rng_state_and_data_position_carry_over(pool, save_cp, load_cp):
    flags = {**GPT, "train-iters": 2, "hidden-dropout": 0.1}
    with tempfile.TemporaryDirectory(prefix="plugtron-cp-rng-") as save:
        train_run({**flags, "cp": save_cp, "save": save, "save-interval": 2}, save_cp, pool)
        path = os.path.join(save, iteration_dirname(2))
        reader = CheckpointReader(path)
        saved = reader.rng_state(0)
        # The premise of the mapping: cp ranks hold the same random streams.
        for rank in range(1, save_cp):
            assert torch.equal(reader.rng_state(rank)["torch"], saved["torch"])
        reader.close()
        results = pool.run(_rng_after_load, {**flags, "cp": load_cp, "load": path},
                           world_size=load_cp)
    for torch_state, tracker, consumed in results:
        assert torch.equal(torch_state, saved["torch"])
        for name, value in saved["tracker"].items():
            assert torch.equal(tracker[name], value), name
        assert consumed == 2 * 8  # two iterations of the global batch
