"""``plugtron evaluate --load DIR``: the validation loss of a checkpoint, in any layout."""

from __future__ import annotations

import os

import click
from plugtron.core.config import CheckpointConfig, LoggingConfig, ParallelConfig, TrainConfig
from plugtron.core.distributed import launched_externally
from plugtron.core.errors import ConfigError
from plugtron.core.validate import validate

from .errors import user_errors
from .launch import launch_local_ranks
from .options import build_config, config_options
from .train import check_data_paths, check_plugins


def evaluation_config(params: dict, config_file: str | None) -> TrainConfig:
    """The checkpoint's own settings (model, data, seed), with the layout, checkpoint and
    logging sections reset; the config file and flags override."""
    from plugtron.core.checkpoint import CheckpointReader

    load = params.get("checkpoint__load")
    if not load:
        raise ConfigError("plugtron evaluate needs --load DIR (a checkpoint or a directory of "
                          "them)")
    reader = CheckpointReader(load)
    base = TrainConfig.from_dict(reader.config)
    base.parallel, base.logging = ParallelConfig(), LoggingConfig()
    base.checkpoint = CheckpointConfig()
    base.model.padded_vocab_size = None  # recomputed for this run's tp
    config = build_config(params, config_file, None, base=base)
    config.checkpoint.load = reader.path
    config.checkpoint.save = config.checkpoint.save_interval = None
    if config.training.eval_iters < 1:
        raise ConfigError("plugtron evaluate needs --eval-iters of at least 1")
    return config


@click.command(context_settings={"max_content_width": 100})
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="YAML or TOML file of settings; flags override it.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Launch this many local ranks (through torch.distributed.run).")
@config_options
@user_errors
def evaluate(config_file, nproc_per_node, **params):
    """Validation loss (valid_lm_loss) of checkpoint --load on the data the data flags give
    (--data, --data-path, --split, --eval-iters), in the layout the parallel flags give. Model
    settings come from the checkpoint; flags override them."""
    config = evaluation_config(params, config_file)
    external = launched_externally()
    world_size = int(os.environ["WORLD_SIZE"]) if external else nproc_per_node
    validate(config, world_size)
    check_plugins(config)
    check_data_paths(config)
    if nproc_per_node > 1 and not external:
        launch_local_ranks(config.to_json(), nproc_per_node, command="evaluate")
        return
    from plugtron.core.checkpoint.evaluate import evaluate_checkpoint

    evaluate_checkpoint(config)
