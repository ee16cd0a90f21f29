"""``plugtron train``."""

from __future__ import annotations

import os

import click
from plugtron.core import registry
from plugtron.core.distributed import launched_externally
from plugtron.core.errors import ConfigError
from plugtron.core.plugin_manager import selected_drivers
from plugtron.core.validate import validate

from .errors import user_errors
from .launch import launch_local_ranks
from .options import (
    SectionedCommand,
    build_config,
    config_options,
    declared_sections,
    headings,
    model_presets,
    prescan,
)


def check_plugins(config) -> None:
    """Unknown or broken plugins are reported before any rank starts."""
    for role, name in selected_drivers(config).items():
        registry.load(role, name)
    backend_cls = registry.load("layer_backend", config.plugins.layer_backend)
    if hasattr(backend_cls, "check_available"):
        backend_cls.check_available()  # e.g. te without transformer-engine or CUDA


def check_data_paths(config) -> None:
    """Files, folders or Megatron prefixes (PREFIX.idx); blend weights are numbers."""
    for path in config.data.data_path:
        if os.path.exists(path) or os.path.exists(f"{path}.idx"):
            continue
        try:
            float(path)
        except ValueError:
            raise ConfigError(f"--data-path {path!r} does not exist") from None


def make_train_command(args: list[str]) -> click.Command:
    """The ``train`` command with the options of the plugins that ``args`` select."""
    selection = prescan(args)
    declared = declared_sections(selection)
    presets = model_presets(selection)

    @click.command(cls=SectionedCommand, headings=headings(declared),
                   context_settings={"max_content_width": 100})
    @click.option("--config", "config_file", type=click.Path(dir_okay=False),
                  help="YAML or TOML file of settings; flags override it.")
    @click.option("--preset", help="Named model size of the selected model: "
                  + (", ".join(sorted(presets)) or "none"))
    @click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
                  help="Launch this many local ranks (through torch.distributed.run).")
    @config_options(declared)
    @user_errors
    def train(config_file, preset, nproc_per_node, **params):
        """Train a model. Under torchrun (or any launcher setting RANK/WORLD_SIZE) each rank
        joins that world; otherwise --nproc-per-node local ranks are started."""
        config = build_config(params, config_file, preset, declared=declared, presets=presets)
        external = launched_externally()
        if external and nproc_per_node > 1:
            raise ConfigError("--nproc-per-node cannot be used under torchrun: the launcher "
                              "already started the ranks")
        world_size = int(os.environ["WORLD_SIZE"]) if external else nproc_per_node
        check_plugins(config)
        validate(config, world_size)
        check_data_paths(config)
        if nproc_per_node > 1:
            launch_local_ranks(config.to_json(), nproc_per_node)
            return
        from plugtron.core.training import pretrain

        pretrain(config)

    return train
