"""Which plugins take part in a run, read off its config alone: the driver of each role (with
Megatron's defaults for ``auto``), the extensions disabled with ``-p no:NAME`` and the
environment switch that turns extension autoloading off. Nothing here imports a plugin."""

from __future__ import annotations

import os

from plugtron.core.errors import ConfigError

AUTOLOAD_ENV = "PLUGTRON_DISABLE_PLUGIN_AUTOLOAD"

#: The config field of ``config.plugins`` that names each driver role.
DRIVER_ROLES = ("model", "schedule", "optimizer", "data_parallel", "dataset")

#: ``--data-parallel-sharding-strategy`` (Megatron's levels) -> what implements it.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def resolve_schedule(config) -> str:
    """``auto`` picks Megatron's default: no pipelining, 1F1B, or interleaved 1F1B."""
    name = config.plugins.schedule
    if name != "auto":
        return name
    par = config.parallel
    if par.pipeline_model_parallel_size <= 1:
        return "no-pipelining"
    if par.virtual_pipeline_model_parallel_size:
        return "interleaved-1f1b"
    return "1f1b"


def resolve_optimizer(config) -> str:
    """``--use-distributed-optimizer`` and ``--data-parallel-sharding-strategy optim`` both
    mean ``distributed-adam``."""
    if (config.parallel.use_distributed_optimizer
            or config.parallel.data_parallel_sharding_strategy == "optim"):
        if config.plugins.optimizer not in ("adam", "distributed-adam"):
            flag = ("--use-distributed-optimizer" if config.parallel.use_distributed_optimizer
                    else "--data-parallel-sharding-strategy optim")
            raise ConfigError(f"{flag} means --optimizer distributed-adam and cannot be "
                              f"combined with --optimizer {config.plugins.optimizer}")
        return "distributed-adam"
    return config.plugins.optimizer


def resolve_data_parallel(config) -> str:
    """``auto`` is ``fsdp2`` under ``--use-torch-fsdp2`` or ``--data-parallel-sharding-strategy
    optim_grads_params``, else ``ddp``. A named wrapper is taken as named."""
    name = config.plugins.data_parallel
    p = config.parallel
    if name == "auto":
        fsdp = p.use_torch_fsdp2 or p.data_parallel_sharding_strategy == "optim_grads_params"
        return "fsdp2" if fsdp else "ddp"
    return name  # a contradiction with --use-torch-fsdp2 is refused by validation


def selected_drivers(config) -> dict[str, str]:
    """role -> entry-point name this run selects."""
    return {
        "model": config.plugins.model,
        "schedule": resolve_schedule(config),
        "optimizer": resolve_optimizer(config),
        "data_parallel": resolve_data_parallel(config),
        "dataset": config.plugins.data,
    }


def disabled_extensions(config) -> set[str]:
    names = set()
    for item in config.plugins.disabled:
        if not item.startswith("no:"):
            raise ConfigError(f"-p {item!r}: only '-p no:NAME' (disable an extension plugin) "
                              f"is supported")
        names.add(item[3:])
    return names


def autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "") not in ("", "0")
