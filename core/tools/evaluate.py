"""The validation loss of a checkpoint (``plugtron evaluate --load DIR``), in any layout.

With several document sets in ``--data-path`` (prefixes of indexed corpora, text files or
folders; the blend weights between them are ignored here) each set is evaluated on its own:
one line per set with its loss and perplexity (``exp`` of the token-weighted mean loss), as
evaluation harnesses report a model on several corpora.
"""

from __future__ import annotations

import copy
import json
import math

from plugtron.core.checkpoint import load_checkpoint
from plugtron.core.contracts.model_info import metric_name
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.plugins.selection import selected_driver
from plugtron.core.training.loop import evaluate_all, loss_metrics, setup, split_sizes


def document_sets(data_path) -> list[str]:
    """The named sets of ``--data-path`` (a blend's weights dropped)."""
    def is_weight(entry) -> bool:
        try:
            float(entry)
        except (TypeError, ValueError):
            return False
        return True

    return [str(entry) for entry in data_path or () if not is_weight(entry)]


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def _line(record: dict) -> str:
    """``SET: lm loss 4.1655 | perplexity 64.4257`` (every reported loss of the set)."""
    parts = [f"{key.removeprefix('valid_').replace('_', ' ')} {value:.4f}"
             for key, value in record.items() if key.startswith("valid_")]
    return f"{record['data_path']}: " + " | ".join(parts)


def evaluate_checkpoint(config, extra_plugins=(), world=None, as_json: bool = False):
    """Build the run for this rank, load the checkpoint's weights, compute the token-weighted
    validation loss over ``--eval-iters`` batches; rank 0 prints every reported key and the
    perplexity, and appends ``{"iteration", "valid_<key>", ...}`` to ``--metrics-file``
    (with ``"data_path"``, one record per set, when there are several sets). ``as_json``: one
    JSON line per set instead. Returns the main loss (of the last set)."""

    run = setup(config, extra_plugins, world)
    reader = load_checkpoint(run, config.checkpoint.load, model_only=True)
    main = run.info.main_loss
    metrics = MetricsLogger(config, run.world.rank, main_loss=metric_name(main))
    sets = document_sets(config.data.data_path)
    loss = None
    try:
        for name in sets if len(sets) > 1 else [None]:
            if name is not None:  # this set's own validation split
                one = copy.deepcopy(config)
                one.data.data_path = [name]
                run.datasets = tuple(run.pm.hook.dataset_provider(
                    config=one, split_sizes=split_sizes(one), parallel=run.parallel))
            label = name or ", ".join(sets) or selected_driver(config, "dataset")
            losses = evaluate_all(run)
            if losses is None:
                if run.world.rank == 0:
                    print(f"{label}: no validation samples (its --split gives the validation "
                          f"split none)", flush=True)
                continue
            loss = losses.get(main)
            record: dict[str, object] = {"iteration": reader.iteration,
                                         **loss_metrics(losses, "valid_")}
            if loss is not None:
                record["valid_perplexity"] = _perplexity(loss)
            # one format for one set and for several: a line (or JSON record) per set
            record = {"data_path": label, **record}
            if run.world.rank == 0:
                metrics.write(record)
                print(json.dumps(record) if as_json else _line(record), flush=True)
    finally:
        metrics.close()
    return loss
