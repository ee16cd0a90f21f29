"""Which plugin? The stevedore side of plugtron: one entry-point group per swappable role.

Listing reads entry-point metadata only, so an uninstalled or broken plugin costs nothing until a
run selects it. Loading goes through stevedore's ``DriverManager``, which imports just the one
entry point that was named.
"""

from __future__ import annotations

import importlib.metadata as metadata
from dataclasses import dataclass

from stevedore import DriverManager
from stevedore.exception import MultipleMatches, NoMatches

from .errors import PluginError

#: role -> entry-point group. The role is what error messages and the CLI call it.
GROUPS: dict[str, str] = {
    "model": "plugtron.models",
    "schedule": "plugtron.schedules",
    "optimizer": "plugtron.optimizers",
    "layer_backend": "plugtron.layer_backends",
    "layer": "plugtron.layers",
    "moe_dispatcher": "plugtron.moe_dispatchers",
    "dataset": "plugtron.datasets",
    "tokenizer": "plugtron.tokenizers",
    "converter": "plugtron.converters",
    "extension": "plugtron",
}


@dataclass(frozen=True)
class PluginInfo:
    """One entry point as its metadata describes it (nothing imported)."""

    role: str
    name: str
    value: str
    distribution: str
    version: str

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version}"


def _group(role: str) -> str:
    try:
        return GROUPS[role]
    except KeyError:
        raise PluginError(f"unknown plugin role {role!r}; roles: {', '.join(GROUPS)}") from None


def available(role: str) -> list[PluginInfo]:
    """Every entry point of a role, sorted by name, read from metadata without importing."""
    infos = []
    for ep in metadata.entry_points(group=_group(role)):
        dist = getattr(ep, "dist", None)
        infos.append(PluginInfo(role, ep.name, ep.value,
                                dist.metadata["Name"] if dist else "?",
                                dist.version if dist else "?"))
    return sorted(infos, key=lambda info: (info.name, info.distribution))


def describe_available(role: str) -> str:
    infos = available(role)
    if not infos:
        return f"no {role} plugins are installed"
    return "available: " + ", ".join(f"{i.name} ({i.origin})" for i in infos)


def load(role: str, name: str):
    """Import and return the object one entry point names (a class, module or function).

    Raises ``PluginError`` for an unknown name (listing those that exist), a name two
    distributions both register, or an entry point that fails to import (naming its
    distribution, version and the exception).
    """
    matches = [info for info in available(role) if info.name == name]
    if not matches:
        raise PluginError(f"unknown {role} {name!r}; {describe_available(role)}")
    if len(matches) > 1:
        raise PluginError(f"{role} {name!r} is registered by more than one distribution: "
                          + ", ".join(m.origin for m in matches) + "; uninstall all but one")
    failures = []

    def on_failure(_manager, entrypoint, exc):
        failures.append(exc)

    try:
        driver = DriverManager(namespace=_group(role), name=name, invoke_on_load=False,
                               on_load_failure_callback=on_failure,
                               on_missing_entrypoints_callback=lambda _names: None)
    except (NoMatches, MultipleMatches, RuntimeError):
        driver = None
    if failures or driver is None:
        info = matches[0]
        reason = f"{type(failures[0]).__name__}: {failures[0]}" if failures else "not loadable"
        raise PluginError(f"{role} {name!r} from {info.origin} failed to import "
                          f"({info.value}): {reason}")
    return driver.driver


def instantiate(obj):
    """Entry points may name a class (instantiated with no arguments) or a module/object."""
    return obj() if isinstance(obj, type) else obj


def check(role: str, name: str) -> str | None:
    """``None`` when the plugin imports, else the error message."""
    try:
        load(role, name)
    except PluginError as exc:
        return str(exc)
    return None
