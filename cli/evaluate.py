"""``plugtron evaluate --load DIR``: the validation loss of a checkpoint, in any layout."""

from __future__ import annotations

import os

import click
from plugtron.core.config import CheckpointConfig, LoggingConfig, ParallelConfig, TrainConfig
from plugtron.core.distributed import launched_externally
from plugtron.core.errors import ConfigError, PlugtronError
from plugtron.core.validate import validate

from .errors import user_errors
from .launch import launch_local_ranks
from .options import (
    SectionedCommand,
    build_config,
    config_options,
    declared_sections,
    headings,
    prescan,
)
from .preflight import preflight
from .train import check_data_paths, check_plugins


#: Tells launched ranks to print JSON lines (``--json``).
JSON_ENV = "PLUGTRON_EVALUATE_JSON"


def checkpoint_base(load: str | None) -> TrainConfig:
    """The checkpoint's own settings (model, data, seed, plugin sections), with the layout,
    checkpoint and logging sections reset."""
    from plugtron.core.checkpoint import CheckpointReader
    from plugtron.core.plugin_options import config_from_dict

    if not load:
        raise ConfigError("plugtron evaluate needs --load DIR (a checkpoint or a directory of "
                          "them)")
    reader = CheckpointReader(load)
    base = config_from_dict(reader.config)
    base.parallel, base.logging = ParallelConfig(), LoggingConfig()
    base.checkpoint = CheckpointConfig()
    base.checkpoint.load = reader.path
    base.model.padded_vocab_size = None  # recomputed for this run's tp
    return base


def evaluation_config(params: dict, config_file: str | None, declared=()) -> TrainConfig:
    """The checkpoint's settings; the config file and flags override."""
    base = checkpoint_base(params.get("checkpoint__load"))
    load = base.checkpoint.load
    config = build_config(params, config_file, None, base=base, declared=declared)
    config.checkpoint.load = load
    config.checkpoint.save = config.checkpoint.save_interval = None
    if config.training.eval_iters < 1:
        raise ConfigError("plugtron evaluate needs --eval-iters of at least 1")
    return config


def _load_argument(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--load" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--load="):
            return arg.split("=", 1)[1]
    return None


def make_evaluate_command(args: list[str]) -> click.Command:
    """``evaluate`` with the options of the plugins the checkpoint (and ``args``) select."""
    try:
        base = checkpoint_base(_load_argument(args))
    except PlugtronError:
        base = None  # reported when the command runs
    declared = declared_sections(prescan(args, base))

    @click.command(cls=SectionedCommand, headings=headings(declared),
                   context_settings={"max_content_width": 100})
    @click.option("--config", "config_file", type=click.Path(dir_okay=False),
                  help="YAML or TOML file of settings; flags override it.")
    @click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
                  help="Launch this many local ranks (through torch.distributed.run).")
    @click.option("--json", "as_json", is_flag=True,
                  help="One JSON line per document set (loss, perplexity) instead of text.")
    @config_options(declared)
    @user_errors
    def evaluate(config_file, nproc_per_node, as_json, **params):
        """Validation losses (valid_<report key>) and perplexity of checkpoint --load on the
        data the data flags give (--data, --data-path, --split, --eval-iters), in the layout
        the parallel flags give; several --data-path sets give one line each. Model settings
        come from the checkpoint; flags override them."""
        config = evaluation_config(params, config_file, declared)
        external = launched_externally()
        world_size = int(os.environ["WORLD_SIZE"]) if external else nproc_per_node
        check_plugins(config)
        preflight(config, world_size)
        validate(config, world_size)
        check_data_paths(config)
        if nproc_per_node > 1 and not external:
            os.environ[JSON_ENV] = "1" if as_json else ""  # the ranks print
            try:
                launch_local_ranks(config.to_json(), nproc_per_node, command="evaluate")
            finally:
                os.environ.pop(JSON_ENV, None)
            return
        from plugtron.core.checkpoint.evaluate import evaluate_checkpoint

        evaluate_checkpoint(config, as_json=as_json)

    return evaluate
