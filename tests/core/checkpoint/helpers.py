"""Training runs that load and save checkpoints, for the checkpoint tests."""

from __future__ import annotations

from plugtron.core import checkpoint
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.training.loop import setup, train

from tests.utils import StepRecorder, tiny_config


def ckpt_config(**overrides):
    """Tiny config for 10 iterations."""
    return tiny_config(**{"train_iters": 10, **overrides})


def train_resumable(config, world=None, stop_at: int | None = None):
    """setup -> --load -> train (with its saves) -> per-iteration losses and the run.

    ``stop_at``: end the loop early (with the final save), as a job that is cut off would, while
    the LR schedule stays that of the full ``--train-iters`` (it is sized from it).
    """
    recorder = StepRecorder()
    run = setup(config, extra_plugins=[recorder], world=world)
    if stop_at is not None:
        run.config.training.train_iters = stop_at
    try:
        checkpoint.load_if_requested(run)
        train(run, MetricsLogger(config, rank=1))
    finally:
        checkpoint.close(run)
    return {r["iteration"]: r["lm_loss"] for r in recorder.records}, run


def params_of(run) -> dict:
    return {n: p.detach().clone() for chunk in run.model_chunks
            for n, p in chunk.module.named_parameters()}
