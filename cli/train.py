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
from .launch import JobStopped, launch_local_ranks
from .options import (
    SectionedCommand,
    build_config,
    config_options,
    declared_sections,
    headings,
    model_presets,
    prescan,
)
from .preflight import preflight


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


def check_load(config) -> None:
    """``--load``: the whole checkpoint is validated (names, headers, pieces) before any rank
    starts, so a hostile or broken one is refused in seconds, not after the model is built."""
    from plugtron.core.checkpoint import CheckpointReader, layout

    path = config.checkpoint.load
    if not path:
        return
    save = config.checkpoint.save
    if save and os.path.abspath(save) == os.path.abspath(path) and not layout.has_checkpoint(path):
        return  # --load equal to --save with nothing saved yet: a fresh start
    CheckpointReader(path).close()
    from plugtron.core.tokenizers import check_checkpoint_tokenizer

    check_checkpoint_tokenizer(config)


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
        preflight(config, world_size)
        validate(config, world_size)
        check_data_paths(config)
        if config.checkpoint.save and int(os.environ.get("RANK", 0)) == 0:
            from plugtron.core.checkpoint import dir_lock

            # Held until this process exits; taking it also repairs crashed saves.
            dir_lock.acquire(config.checkpoint.save)
        check_load(config)
        if nproc_per_node > 1:
            launch_local_ranks(config.to_json(), nproc_per_node)
            return
        from plugtron.core import preemption
        from plugtron.core.distributed import init_distributed, timeout_seconds
        from plugtron.core.training import pretrain

        preemption.install(extra=config.training.exit_signal_handler)
        init_distributed(timeout_seconds(config))
        pretrain(config)
        if preemption.stopped is not None:
            raise JobStopped(preemption.final_message(config), preemption.stopped[1])

    return train
