"""``plugtron train``."""

from __future__ import annotations

import os

import click
from plugtron.core import registry
from plugtron.core.distributed import launched_externally
from plugtron.core.errors import ConfigError
from plugtron.core.plugin_manager import selected_drivers
from plugtron.core.presets import PRESETS
from plugtron.core.validate import validate

from .errors import user_errors
from .launch import launch_local_ranks
from .options import apply_extra, build_config, config_options, extension_options, extra_options

EXTENSION_OPTIONS = extension_options()


def check_plugins(config) -> None:
    """Unknown or broken plugins are reported before any rank starts."""
    for role, name in selected_drivers(config).items():
        registry.load(role, name)
    backend_cls = registry.load("layer_backend", config.plugins.layer_backend)
    if hasattr(backend_cls, "check_available"):
        backend_cls.check_available()  # e.g. te without transformer-engine or CUDA


def check_data_paths(config) -> None:
    for path in config.data.data_path:
        if not os.path.exists(path):
            raise ConfigError(f"--data-path {path!r} does not exist")


@click.command(context_settings={"max_content_width": 100})
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="YAML or TOML file of settings; flags override it.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Named model size.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Launch this many local ranks (through torch.distributed.run).")
@config_options
@extra_options(EXTENSION_OPTIONS)
@user_errors
def train(config_file, preset, nproc_per_node, **params):
    """Train a model. Under torchrun (or any launcher setting RANK/WORLD_SIZE) each rank joins
    that world; otherwise --nproc-per-node local ranks are started."""
    config = build_config(params, config_file, preset)
    apply_extra(config, EXTENSION_OPTIONS, params)
    external = launched_externally()
    if external and nproc_per_node > 1:
        raise ConfigError("--nproc-per-node cannot be used under torchrun: the launcher "
                          "already started the ranks")
    world_size = int(os.environ["WORLD_SIZE"]) if external else nproc_per_node
    validate(config, world_size)
    check_plugins(config)
    check_data_paths(config)
    if nproc_per_node > 1:
        launch_local_ranks(config.to_json(), nproc_per_node)
        return
    from plugtron.core.training import pretrain

    pretrain(config)
