"""Who else wants to know? The per-run pluggy ``PluginManager``.

For one run: the drivers that the run selected by entry-point name (model, schedule, optimizer,
dataset) are registered first, then the extension plugins of group ``plugtron`` (loaded the way
pytest loads ``pytest11``). Then every contract hook must have exactly one implementation.
"""

from __future__ import annotations

import pluggy
from plugtron.core.contracts import hookspecs
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.objects import AUTOLOAD_ENV, autoload_disabled, disabled_extensions

__all__ = ["AUTOLOAD_ENV", "build_plugin_manager", "disabled_extensions", "selected_drivers"]

#: The config field of ``config.plugins`` that names each driver role.
DRIVER_ROLES = ("model", "schedule", "optimizer", "dataset")


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
    if config.parallel.use_distributed_optimizer:
        if config.plugins.optimizer not in ("adam", "distributed-adam"):
            raise ConfigError(f"--use-distributed-optimizer is an alias of --optimizer "
                              f"distributed-adam and cannot be combined with --optimizer "
                              f"{config.plugins.optimizer}")
        return "distributed-adam"
    return config.plugins.optimizer


def selected_drivers(config) -> dict[str, str]:
    """role -> entry-point name this run selects."""
    return {
        "model": config.plugins.model,
        "schedule": resolve_schedule(config),
        "optimizer": resolve_optimizer(config),
        "dataset": config.plugins.data,
    }


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def load_extensions(pm: pluggy.PluginManager, disabled: set[str]) -> None:
    """Register every extension plugin of group ``plugtron`` that is not disabled."""
    if autoload_disabled():
        return
    for info in registry.available("extension"):
        if info.name in disabled or pm.is_blocked(info.name):
            continue
        try:
            obj = registry.instantiate(registry.load("extension", info.name))
        except PluginError as exc:
            raise PluginError(f"{exc}; disable it with `-p no:{info.name}` or "
                              f"{AUTOLOAD_ENV}=1") from None
        pm.register(obj, name=info.name)


def register_driver(pm: pluggy.PluginManager, role: str, name: str) -> None:
    pm.register(registry.instantiate(registry.load(role, name)), name=f"{role}:{name}")


def build_plugin_manager(config, extra_plugins=()) -> pluggy.PluginManager:
    """The run's plugin manager: selected drivers, extensions, then the contract check."""
    pm = new_plugin_manager()
    for role, name in selected_drivers(config).items():
        register_driver(pm, role, name)
    disabled = disabled_extensions(config)
    for name in disabled:
        pm.set_blocked(name)
    load_extensions(pm, disabled)
    for obj in extra_plugins:
        pm.register(obj)
    verify_contracts(pm)
    return pm


def verify_contracts(pm: pluggy.PluginManager) -> None:
    """Each contract hook must have exactly one (non-wrapper) implementation."""
    problems = []
    for hook_name, role in hookspecs.CONTRACT_HOOKS.items():
        impls = [impl for impl in getattr(pm.hook, hook_name).get_hookimpls()
                 if not (impl.hookwrapper or impl.wrapper)]
        names = [impl.plugin_name for impl in impls]
        if not impls:
            problems.append(f"no plugin implements {hook_name!r}; the selected {role} driver "
                            f"should")
        elif len(impls) > 1:
            problems.append(f"{hook_name!r} is implemented by more than one plugin: "
                            f"{', '.join(names)}; exactly one may implement a contract hook")
    for hook_name, role in hookspecs.OPTIONAL_DRIVER_HOOKS.items():
        impls = [impl for impl in getattr(pm.hook, hook_name).get_hookimpls()
                 if not (impl.hookwrapper or impl.wrapper)]
        if len(impls) > 1:
            problems.append(f"{hook_name!r} is implemented by more than one plugin: "
                            f"{', '.join(i.plugin_name for i in impls)}; only the {role} "
                            f"driver may")
    if problems:
        raise PluginError("; ".join(problems))


def wants_sharded_gradients(config, pm: pluggy.PluginManager | None = None) -> bool:
    """The answer of hook ``optimizer_shards_gradients`` (no implementation means no).

    ``pm`` is the run's plugin manager. Without one (validation before launch) a plugin manager
    of just the selected optimizer answers, so no other plugin is imported.
    """
    if pm is None:
        pm = new_plugin_manager()
        register_driver(pm, "optimizer", resolve_optimizer(config))
    return bool(pm.hook.optimizer_shards_gradients(config=config))
