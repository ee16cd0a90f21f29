"""Shared helpers for tests: tiny configs and in-process training runs."""

from __future__ import annotations

from plugtron.core.config import TrainConfig
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.plugins.options import config_from_flags
from plugtron.core.training.loop import setup, train

TINY = {
    "num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 16,
    "micro-batch-size": 2, "global-batch-size": 8, "train-iters": 4, "lr": 1e-3,
    "min-lr": 1e-4, "lr-warmup-iters": 1, "eval-interval": 0, "hidden-dropout": 0.0,
    "attention-dropout": 0.0, "data": "mock", "vocab-size": 100,
    "make-vocab-size-divisible-by": 8, "progress": False, "log-interval": 0,
}


def tiny_config(**overrides) -> TrainConfig:
    """A seconds-long fp32 run on mock data without dropout; keys are flag names with
    underscores or dashes (``num_layers=4``, ``tp=2``)."""
    return config_from_flags({**TINY, **overrides}, "test")


class StepRecorder:
    """Extension plugin that keeps every step's metrics."""

    def __init__(self):
        self.records = []

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        self.records.append(dict(metrics))


def train_in_process(config: TrainConfig, world=None):
    """Train on this process's world (or ``world``); returns (per-step records, run)."""
    recorder = StepRecorder()
    run = setup(config, extra_plugins=[recorder], world=world)
    metrics = MetricsLogger(config, rank=1)  # rank != 0: writes nothing
    train(run, metrics)
    return recorder.records, run
