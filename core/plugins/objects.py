"""The plugins that take part in a run, and calling what they declare.

Options (``plugtron_config_sections``) and checks (``plugtron_validate``) are collected the way
pytest collects ``pytest_addoption``: from the drivers the run selected, its layer backend, every
installed plugin of an always-collected role (layer types, and any role a distribution
declares so), and every extension that is not disabled. Only the
selected drivers are imported among the drivers, so an uninstalled or broken driver that the run
does not select costs nothing; a broken layer type or extension is skipped with one
warning that names it, and the others keep their options.

Drivers and extensions are instances (their methods may be pluggy ``hookimpl``\\ s); layer types,
layer backends and plugins of declared roles are classes, which declare these as ``staticmethod`` or
``classmethod``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.plugins import registry
from plugtron.core.plugins.selection import (
    DRIVER_ROLES,
    autoload_disabled,
    disabled_extensions,
    installed_selectors,
    selected_drivers,
)
from plugtron.core.plugins.signatures import declared_arguments

_warned: set[str] = set()


@dataclass(frozen=True)
class PluginObject:
    role: str
    name: str
    origin: str  # "distribution version"
    obj: object

    @property
    def label(self) -> str:
        return f"{self.role} {self.name!r} ({self.origin})"


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"plugtron: warning: {message}", file=sys.stderr, flush=True)


def _origin(role: str, name: str) -> str:
    info = next((i for i in registry.available(role) if i.name == name), None)
    return info.origin if info else "?"


def run_plugin_objects(config, strict_drivers: bool = False) -> list[PluginObject]:
    """Every plugin that takes part in a run of ``config``. A selected driver that fails to
    import raises when ``strict_drivers`` (a run needs it), else it is skipped with a warning
    (building ``--help`` must not fail on it); other plugins are always skipped with a
    warning."""
    out = [PluginObject("selector", info.name, info.origin, cls)  # they own the flags that
           for info, cls in installed_selectors()]  # choose the drivers: first
    roles = (*DRIVER_ROLES, "layer_backend")
    try:
        drivers = selected_drivers(config, roles=roles)
    except ConfigError:
        if strict_drivers:
            raise
        drivers = {}  # contradicting flags: the run's own check reports them; the others
        for role in roles:  # still take part
            try:
                drivers[role] = selected_drivers(config, roles=(role,))[role]
            except ConfigError:
                continue
    for role, name in drivers.items():
        try:
            obj = registry.load(role, name)
        except PluginError as exc:
            if strict_drivers:
                raise
            if not isinstance(exc, registry.UnknownPluginError):  # the run's own check says it
                warn_once(f"skipping the options of {role} {name!r}: {exc}")
            continue
        if role != "layer_backend":
            obj = registry.instantiate(obj)
        out.append(PluginObject(role, name, _origin(role, name), obj))
    out += _always_collected([r for r in registry.always_collected_roles() if r != "selector"])
    if not autoload_disabled():
        try:
            disabled = disabled_extensions(config)
        except ConfigError:  # a malformed -p: the run's own check reports it, after the options
            disabled = set()
        for info in registry.available("extension"):
            if info.name in disabled:
                continue
            try:
                obj = registry.instantiate(registry.load("extension", info.name))
            except PluginError as exc:
                warn_once(f"skipping extension {info.name!r}: {exc}; disable it with "
                          f"`-p no:{info.name}`")
                continue
            out.append(PluginObject("extension", info.name, info.origin, obj))
    return out


def _always_collected(roles: list[str]) -> list[PluginObject]:
    """Every installed plugin of ``roles`` (classes: their hooks are static)."""
    out = []
    for role in roles:
        for info in registry.available(role):
            try:
                out.append(PluginObject(role, info.name, info.origin,
                                        registry.load(role, info.name)))
            except PluginError as exc:
                warn_once(f"skipping {role} {info.name!r}: {exc}")
    return out


def call_declared(plugin: PluginObject, method: str, **kwargs):
    """Call ``plugin.obj.<method>`` with the arguments it declares (like pluggy: a subset of
    the hook's); ``None`` when the plugin does not declare it."""
    fn = getattr(plugin.obj, method, None)
    if fn is None or not callable(fn):
        return None
    wanted = declared_arguments(fn)
    if wanted is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in wanted}
    return fn(**kwargs)

