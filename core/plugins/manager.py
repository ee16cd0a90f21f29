"""Who else wants to know? The per-run pluggy ``PluginManager``.

For one run: the drivers that the run selected by entry-point name (model, schedule, optimizer,
dataset) are registered first, then the model transforms it selects (named
``model_transform:NAME``, in the run's order), then the extension plugins of group ``plugtron``
(loaded the way pytest loads ``pytest11``). Then every contract hook must have exactly one
implementation, and every transform hook one per transform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy
from plugtron.core.contracts import hookspecs
from plugtron.core.errors import PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import (
    AUTOLOAD_ENV,
    TRANSFORM_ROLE,
    autoload_disabled,
    disabled_extensions,
    resolve_data_parallel,
    resolve_optimizer,
    selected_drivers,
    selected_transforms,
)

if TYPE_CHECKING:
    import torch

__all__ = ["build_plugin_manager", "data_parallel_memory", "new_plugin_manager", "optimizer_state_per_param",
           "implements", "register_transforms", "takes_dtensor_params", "transform_caller",
           "verify_contracts",
           "wants_sharded_gradients"]

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


def register_transforms(pm: pluggy.PluginManager, config) -> list[str]:
    """Register the model transforms a run of ``config`` applies (``model_transform:NAME``);
    their names in the run's order."""
    names = selected_transforms(config)
    for name in names:
        register_driver(pm, TRANSFORM_ROLE, name)
    return names


def transform_caller(pm: pluggy.PluginManager, name: str, names: list[str],
                     hook: str = "transform_model_chunk"):
    """Transform hook ``hook`` of transform ``name`` alone among the run's ``names``: the
    other transforms left out, every wrapper (an extension's) kept."""
    others = [pm.get_plugin(f"{TRANSFORM_ROLE}:{other}") for other in names if other != name]
    return pm.subset_hook_caller(hook, remove_plugins=[p for p in others if p is not None])


def implements(pm: pluggy.PluginManager, plugin_name: str, hook: str) -> bool:
    """Whether plugin ``plugin_name`` of ``pm`` implements ``hook`` (not only wraps it)."""
    return any(impl.plugin_name == plugin_name and not (impl.hookwrapper or impl.wrapper)
               for impl in getattr(pm.hook, hook).get_hookimpls())


def build_plugin_manager(config, extra_plugins=()) -> pluggy.PluginManager:
    """The run's plugin manager: selected drivers, model transforms, extensions, then the
    contract check."""
    pm = new_plugin_manager()
    for role, name in selected_drivers(config).items():
        register_driver(pm, role, name)
    register_transforms(pm, config)
    disabled = disabled_extensions(config)
    for name in disabled:
        pm.set_blocked(name)
    load_extensions(pm, disabled)
    for obj in extra_plugins:
        pm.register(obj)
    verify_contracts(pm)
    return pm


def verify_contracts(pm: pluggy.PluginManager) -> None:
    """Each contract hook must have exactly one (non-wrapper) implementation, an optional
    driver hook at most one; each model transform implements the transform hooks, and only
    transforms implement them (extensions may wrap them)."""
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
        if role == TRANSFORM_ROLE:
            continue  # one per transform: checked below
        impls = [impl for impl in getattr(pm.hook, hook_name).get_hookimpls()
                 if not (impl.hookwrapper or impl.wrapper)]
        if len(impls) > 1:
            problems.append(f"{hook_name!r} is implemented by more than one plugin: "
                            f"{', '.join(i.plugin_name for i in impls)}; only the {role} "
                            f"driver may")
    transforms = {name for name, _ in pm.list_name_plugin()
                  if name.startswith(f"{TRANSFORM_ROLE}:")}
    optional = [h for h, role in hookspecs.OPTIONAL_DRIVER_HOOKS.items() if role == TRANSFORM_ROLE]
    for hook_name in [*hookspecs.TRANSFORM_HOOKS, *optional]:
        impls = [impl for impl in getattr(pm.hook, hook_name).get_hookimpls()
                 if not (impl.hookwrapper or impl.wrapper)]
        owners = {impl.plugin_name for impl in impls}
        required = hook_name in hookspecs.TRANSFORM_HOOKS
        for name in sorted(transforms - owners) if required else []:
            problems.append(f"model transform {name.split(':', 1)[1]!r} does not implement "
                            f"{hook_name!r}")
        for name in sorted(owners - transforms):
            problems.append(f"{hook_name!r} is implemented by {name}, which is no model "
                            f"transform of this run; only transforms may (others wrap it)")
    if problems:
        raise PluginError("; ".join(problems))


def wants_sharded_gradients(config, pm: pluggy.PluginManager | None = None) -> bool:
    """The answer of hook ``optimizer_shards_gradients`` (no implementation means no).

    ``pm`` is the run's plugin manager. Without one (validation before launch) a plugin manager
    of just the selected optimizer answers, so no other plugin is imported.
    """
    return bool(_optimizer_hooks(config, pm).optimizer_shards_gradients(config=config))


def takes_dtensor_params(config, pm: pluggy.PluginManager | None = None) -> bool:
    """The answer of hook ``optimizer_takes_dtensor_params`` (no implementation means no).
    ``pm`` as for :func:`wants_sharded_gradients`."""
    return bool(_optimizer_hooks(config, pm).optimizer_takes_dtensor_params(config=config))


def shards_layer_wise(config, pm: pluggy.PluginManager | None = None) -> bool:
    """The answer of hook ``optimizer_shards_layer_wise`` (no implementation means no).
    ``pm`` as for :func:`wants_sharded_gradients`."""
    return bool(_optimizer_hooks(config, pm).optimizer_shards_layer_wise(config=config))


def optimizer_state_per_param(config, pm: pluggy.PluginManager | None = None
                              ) -> Callable[[str, torch.nn.Parameter], int] | None:
    """The answer of hook ``optimizer_state_per_param`` as ``values(name, param)``, fp32 values
    per element of one parameter; None when the optimizer does not implement the hook. ``pm``
    as for :func:`wants_sharded_gradients` (one plugin manager for every parameter asked)."""
    hook = _optimizer_hooks(config, pm).optimizer_state_per_param
    if not hook.get_hookimpls():
        return None

    def values(name: str, param: torch.nn.Parameter) -> int:
        return int(hook(config=config, name=name, param=param))

    return values


def data_parallel_memory(config, **kwargs):
    """The answer of the data-parallel driver's hook ``data_parallel_memory`` (None when it
    does not implement it), from a plugin manager of just that driver."""
    pm = new_plugin_manager()
    register_driver(pm, "data_parallel", resolve_data_parallel(config))
    return pm.hook.data_parallel_memory(config=config, **kwargs)


def _optimizer_hooks(config, pm: pluggy.PluginManager | None):
    """The hooks of ``pm``, or of a plugin manager of just the selected optimizer."""
    if pm is None:
        pm = new_plugin_manager()
        register_driver(pm, "optimizer", resolve_optimizer(config))
    return pm.hook
