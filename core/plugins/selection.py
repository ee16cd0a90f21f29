"""Which plugins take part in a run, read off its config alone: the driver of each role (what
the installed selectors answer for ``auto`` and for Megatron-style flags, else the name given),
the extensions disabled with ``-p no:NAME`` and the environment switch that turns extension
autoloading off. Only selectors are imported here: small plugins that map flags to names."""

from __future__ import annotations

import os

from plugtron.core.contracts.selectors import Fallback
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.signatures import declared_arguments

AUTOLOAD_ENV = "PLUGTRON_DISABLE_PLUGIN_AUTOLOAD"

#: The config field of ``config.plugins`` that names each driver role.
DRIVER_ROLES = ("model", "schedule", "optimizer", "data_parallel", "dataset")

#: The ``config.plugins`` field and the flag that name each role a selector can answer.
FIELDS = {"model": "model", "schedule": "schedule", "optimizer": "optimizer",
          "data_parallel": "data_parallel", "dataset": "data", "layer_backend": "layer_backend"}
FLAGS = {"model": "--model", "schedule": "--schedule", "optimizer": "--optimizer",
         "data_parallel": "--data-parallel", "dataset": "--data",
         "layer_backend": "--layer-backend"}


_loaded: tuple[object, list] | None = None


def installed_selectors() -> list:
    """Every installed selector (group ``plugtron.selectors``), loaded once while nothing
    installed changes (drivers are resolved a hundred times in a run's set-up); one that does
    not load is skipped here (``plugins list --check`` reports it)."""
    global _loaded
    installed = registry.snapshot()
    if _loaded is None or _loaded[0] is not installed:
        out = []
        for info in registry.available("selector"):
            try:
                out.append((info, registry.load_entry_point(info)))  # a class: static hooks
            except PluginError:
                continue
        _loaded = (installed, out)
    return _loaded[1]


def selector_answer(role: str, config, selectors: list | None = None) -> str | None:
    """The driver that the installed selectors' flags choose for ``role`` (hook
    ``plugtron_select``), or None when none answers. Two that answer differently are a
    ``ConfigError`` naming both."""
    answers: dict[str, str] = {}
    fallbacks: dict[str, str] = {}
    for info, selector in installed_selectors() if selectors is None else selectors:
        select = getattr(selector, "plugtron_select", None)
        if select is None:
            continue
        wanted = declared_arguments(select)
        kwargs = {"role": role, "config": config}
        answer = select(**{k: v for k, v in kwargs.items() if wanted is None or k in wanted})
        if answer is not None:
            who = f"selector {info.name!r} ({info.origin})"
            (fallbacks if isinstance(answer, Fallback) else answers)[who] = str(answer)
    for level in (answers, fallbacks):  # a flag's choice wins over any fallback
        if len(set(level.values())) > 1:
            raise ConfigError(f"the {role} is ambiguous: " + "; ".join(
                f"{who} selects {name!r}" for who, name in level.items())
                + f"; give {FLAGS.get(role, role)} NAME")
        if level:
            return next(iter(level.values()))
    return None


def resolve(role: str, config, selectors: list | None = None) -> str:
    """The driver a run of ``config`` uses for ``role``: what a selector answers (Megatron's
    defaults for ``auto``, a flag such as ``--use-torch-fsdp2``; built in: plugins/selectors/),
    else the name given. ``auto`` that no selector answers is a ``ConfigError``."""
    answer = selector_answer(role, config, selectors)
    if answer is not None:
        return answer
    name = getattr(config.plugins, FIELDS[role])
    if name == "auto":
        raise ConfigError(f"{FLAGS[role]} auto: no installed selector (plugtron.selectors) "
                          f"chooses a {role} for this run; give {FLAGS[role]} NAME "
                          f"({registry.describe_available(role)})")
    return name


def selected_driver(config, role: str) -> str:
    """The entry-point name of the plugin that a run of ``config`` uses for ``role`` (a driver
    role or ``layer_backend``): read it here rather than from ``config.plugins``, which may
    say ``auto``."""
    return resolve(role, config)


#: The roles whose plugin does not depend on the layout: their choice is written into the
#: config (validation, and a checkpoint's saved config), the others stay ``auto`` so a resumed
#: run in another layout chooses again.
FIXED_ROLES = ("model", "layer_backend", "dataset")


def chosen_names(config) -> dict[str, str]:
    """``config.plugins`` field -> the name chosen for each of :data:`FIXED_ROLES`."""
    selectors = installed_selectors()
    return {FIELDS[role]: resolve(role, config, selectors) for role in FIXED_ROLES}


def derive_driver_names(config) -> None:
    """Write the chosen names of :data:`FIXED_ROLES`, and the model transforms in their order,
    into ``config.plugins``, so a saved config names the plugins it ran with whatever
    selectors are installed where it is read.
    Part of validation."""
    for field, name in chosen_names(config).items():
        setattr(config.plugins, field, name)
    # The transforms a transform's own flags turn on are named too: a saved config then builds
    # the same model wherever it is read (load_model).
    config.plugins.model_transforms = selected_transforms(config)


#: The role of model transforms (hook ``transform_model_chunk``): several per run, in order.
TRANSFORM_ROLE = "model_transform"
TRANSFORMS_FLAG = "--model-transforms"


def named_transforms(config) -> list[str]:
    """The transforms ``--model-transforms`` names, in its order (values may be
    comma-separated), each once."""
    out: list[str] = []
    for item in config.plugins.model_transforms:
        for name in str(item).split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return out


def selected_transforms(config) -> list[str]:
    """The model transforms a run of ``config`` applies, in the order it applies them: those
    ``--model-transforms`` names, then every installed transform that answers hook
    ``plugtron_select`` for role ``model_transform`` (its own flags turn it on), by entry-point
    name. A name no installed transform has is a ``ConfigError`` listing those that exist."""
    out = named_transforms(config)
    available = registry.available(TRANSFORM_ROLE)
    known = {info.name for info in available}
    for name in out:
        if name not in known:
            raise ConfigError(f"{TRANSFORMS_FLAG} {name!r}: no such model transform"
                              f"{registry.did_you_mean(name, sorted(known))}; "
                              f"{registry.describe_available(TRANSFORM_ROLE)}")
    for info in available:
        try:
            transform = registry.load_entry_point(info)
        except PluginError:
            continue  # one that does not import answers nothing (plugins check reports it)
        select = getattr(transform, "plugtron_select", None)
        if select is None:
            continue
        wanted = declared_arguments(select)
        kwargs = {"role": TRANSFORM_ROLE, "config": config}
        answer = select(**{k: v for k, v in kwargs.items() if wanted is None or k in wanted})
        if answer is not None and str(answer) not in out:
            if str(answer) not in known:
                raise ConfigError(f"model transform {info.name!r} ({info.origin}) turns on "
                                  f"{answer!r}, which is not installed")
            out.append(str(answer))
    return out


#: The question a selector answers (hook ``plugtron_select``) when a run's flags ask for the
#: optimizer's state sharded over data parallelism (Megatron's ``--use-distributed-optimizer``).
OPTIMIZER_SHARDING = "optimizer_sharding"


def optimizer_sharding_requested(config) -> bool:
    """Whether the run's flags ask for the optimizer's state sharded over data parallelism: a
    selector answers ``plugtron_select(role="optimizer_sharding")`` with ``"data_parallel"``
    (the built-in ``megatron`` does for ``--use-distributed-optimizer``). Adam answers with
    ``distributed-adam``; an optimizer that needs whole tensors shards layer-wise."""
    return selector_answer(OPTIMIZER_SHARDING, config) is not None


def resolve_schedule(config) -> str:
    return resolve("schedule", config)


def resolve_optimizer(config) -> str:
    return resolve("optimizer", config)


def resolve_data_parallel(config) -> str:
    return resolve("data_parallel", config)


def selected_drivers(config, roles: tuple[str, ...] = DRIVER_ROLES) -> dict[str, str]:
    """role -> entry-point name this run selects (``layer_backend`` only when asked for)."""
    selectors = installed_selectors()
    return {role: resolve(role, config, selectors) for role in roles}


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
