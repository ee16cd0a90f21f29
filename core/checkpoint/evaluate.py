"""The validation loss of a checkpoint (``plugtron evaluate --load DIR``), in any layout."""

from __future__ import annotations

from ..metrics import MetricsLogger
from . import load_checkpoint


def evaluate_checkpoint(config, extra_plugins=(), world=None) -> float | None:
    """Build the run for this rank, load the checkpoint's weights, compute the token-weighted
    validation loss over ``--eval-iters`` batches; rank 0 prints every reported key and
    appends ``{"iteration", "valid_<key>", ...}`` to ``--metrics-file``. Returns the main
    loss."""
    from ..model_info import metric_name
    from ..training import evaluate_all, loss_metrics, setup

    run = setup(config, extra_plugins, world)
    reader = load_checkpoint(run, config.checkpoint.load, model_only=True)
    losses = evaluate_all(run)
    metrics = MetricsLogger(config, run.world.rank, main_loss=metric_name(run.info.main_loss))
    try:
        if losses is not None:
            metrics.evaluation({"iteration": reader.iteration, **loss_metrics(losses, "valid_")})
    finally:
        metrics.close()
    return None if losses is None else losses.get(run.info.main_loss)
