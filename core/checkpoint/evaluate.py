"""The validation loss of a checkpoint (``plugtron evaluate --load DIR``), in any layout."""

from __future__ import annotations

from ..metrics import MetricsLogger
from . import load_checkpoint


def evaluate_checkpoint(config, extra_plugins=(), world=None) -> float | None:
    """Build the run for this rank, load the checkpoint's weights, compute the token-weighted
    validation loss over ``--eval-iters`` batches; rank 0 prints it and appends
    ``{"iteration", "valid_lm_loss"}`` to ``--metrics-file``."""
    from ..training import evaluate, setup

    run = setup(config, extra_plugins, world)
    reader = load_checkpoint(run, config.checkpoint.load, model_only=True)
    loss = evaluate(run)
    metrics = MetricsLogger(config, run.world.rank)
    try:
        if loss is not None:
            metrics.evaluation({"iteration": reader.iteration, "valid_lm_loss": loss})
    finally:
        metrics.close()
    return loss
