"""Resume in one process: bitwise-identical losses, sync and async, and what --load accepts."""

from __future__ import annotations

import os

import pytest
import torch
from plugtron.core.checkpoint import CheckpointReader, layout
from plugtron.core.errors import CheckpointError
from plugtron.core.parallel.distributed import single_process

from .helpers import ckpt_config, params_of, train_resumable

ONE = single_process()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """10 iterations, saving every 5."""
    save = str(tmp_path_factory.mktemp("ref"))
    losses, run = train_resumable(ckpt_config(save=save, save_interval=5), ONE)
    return save, losses, params_of(run)


def test_resume_is_bitwise(reference):
    save, losses, params = reference
    resumed, run = train_resumable(ckpt_config(load=os.path.join(save, "iter_0000005")), ONE)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert [resumed[i] for i in range(6, 11)] == [losses[i] for i in range(6, 11)]
    assert run.state.consumed_samples == 80
    for name, value in params_of(run).items():
        assert torch.equal(value, params[name]), name


def test_async_save_resumes_bitwise(reference, tmp_path):
    """Stop at 5 with an async save, resume to 10."""
    save, losses, _ = reference
    first, run = train_resumable(ckpt_config(save=str(tmp_path), async_save=True), ONE,
                                 stop_at=5)
    # writing in the background disturbs nothing
    assert first == {i: losses[i] for i in range(1, 6)}
    assert run.checkpointer.pending is None  # waited for at the end
    resumed, _ = train_resumable(ckpt_config(load=str(tmp_path)), ONE)
    assert [resumed[i] for i in range(6, 11)] == [losses[i] for i in range(6, 11)]
    sync = CheckpointReader(os.path.join(save, "iter_0000005"))
    other = CheckpointReader(str(tmp_path / "iter_0000005"))
    assert sorted(sync.tensors) == sorted(other.tensors)
    for name in sync.tensors:
        assert torch.equal(sync.read_full(name), other.read_full(name)), name


def test_resume_sgd_bf16(tmp_path):
    """SGD state (momentum, no step count) and bf16 (fp32 main params saved as optimizer
    state): resumed losses bitwise equal."""
    settings = {"optimizer": "sgd", "bf16": True, "train_iters": 4, "global_batch_size": 2}
    losses, _ = train_resumable(ckpt_config(save=str(tmp_path), save_interval=2, **settings),
                                ONE)
    reader = CheckpointReader(str(tmp_path / "iter_0000002"))
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert reader.tensors[f"model/{qkv}"].dtype == "bfloat16"
    assert reader.tensors[f"optim/{qkv}/main_param"].dtype == "float32"
    assert f"optim/{qkv}/momentum_buffer" in reader.tensors
    resumed, _ = train_resumable(ckpt_config(load=str(tmp_path / "iter_0000002"), **settings),
                                 ONE)
    assert [resumed[i] for i in (3, 4)] == [losses[i] for i in (3, 4)]


def test_load_parent_takes_newest_and_latest_points_at_it(reference):
    save, _, _ = reference
    assert layout.read_latest(save) == "iter_0000010"
    assert CheckpointReader(save).iteration == 10
    # a directory without metadata.json (an interrupted save that got renamed by hand) is skipped
    os.makedirs(os.path.join(save, "iter_0000020"), exist_ok=True)
    try:
        assert CheckpointReader(save).iteration == 10
    finally:
        os.rmdir(os.path.join(save, "iter_0000020"))
    resumed, run = train_resumable(ckpt_config(load=save), ONE)
    assert resumed == {} and run.state.iteration == 10  # nothing left to train


def test_load_equal_to_save_starts_fresh_when_empty(tmp_path):
    losses, _ = train_resumable(ckpt_config(save=str(tmp_path), load=str(tmp_path),
                                            train_iters=2), ONE)
    assert sorted(losses) == [1, 2]
    assert CheckpointReader(str(tmp_path)).iteration == 2  # saved at the end


def test_load_errors(reference, tmp_path):
    save, _, _ = reference
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train_resumable(ckpt_config(load=str(tmp_path)), ONE)
    with pytest.raises(CheckpointError, match="no such directory"):
        train_resumable(ckpt_config(load=str(tmp_path / "missing")), ONE)
    with pytest.raises(CheckpointError, match=r"--hidden-size 32 \(this run: 64\)"):
        train_resumable(ckpt_config(load=save, hidden_size=64), ONE)
    with pytest.raises(CheckpointError, match="--swiglu"):
        train_resumable(ckpt_config(load=save, swiglu=True), ONE)


def test_weights_only_load_keeps_fresh_optimizer(reference):
    from plugtron.core.checkpoint import load_checkpoint
    from plugtron.core.training.loop import setup

    save, _, params = reference
    run = setup(ckpt_config(), world=ONE)
    load_checkpoint(run, save, model_only=True)
    assert run.state.iteration == 0
    assert all(not s for s in run.optimizer.inner.state.values())
    for name, value in params_of(run).items():
        assert torch.equal(value, params[name]), name


def test_exit_on_missing_checkpoint(tmp_path):
    # Megatron's flag: an empty --load (here also --save, the restartable-job case that plugtron
    # otherwise starts from scratch) exits instead; a --load elsewhere without one is refused
    # with or without it
    from click.testing import CliRunner
    from plugtron.cli.main import cli

    from tests.reliability.tools import tiny_flags

    empty = str(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint"):
        train_resumable(ckpt_config(save=empty, load=empty, exit_on_missing_checkpoint=True),
                        ONE)
    losses, _ = train_resumable(ckpt_config(save=empty, load=empty, train_iters=1), ONE)
    assert sorted(losses) == [1]
    other = str(tmp_path / "other")
    os.makedirs(other)
    out = CliRunner().invoke(cli, ["train", *tiny_flags(train_iters=1), "--save", other,
                                   "--load", other, "--exit-on-missing-checkpoint"])
    assert out.exit_code == 2 and "--exit-on-missing-checkpoint" in out.output, out.output
