"""Which plugin? The stevedore side of plugtron: one entry-point group per swappable role.

Listing reads entry-point metadata only, so an uninstalled or broken plugin costs nothing until a
run selects it. Loading imports exactly the ``importlib.metadata`` entry point that listing found
and hands it to stevedore as the one driver of its group. stevedore's own entry-point scan is
never used: its cache (in memory and on disk) is keyed by directory mtimes packed into 32-bit
floats, about two minutes of resolution, so a plugin re-installed with a new entry point would
be listed here but "not found" there.
"""

from __future__ import annotations

import importlib.metadata as metadata
from dataclasses import dataclass, field

from plugtron.core.errors import PluginError
from stevedore import DriverManager
from stevedore.extension import Extension

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
    #: The metadata object itself: :func:`load` imports exactly this one.
    entry_point: metadata.EntryPoint = field(compare=False, repr=False)

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
                                dist.version if dist else "?", ep))
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
    return load_entry_point(matches[0])


def load_entry_point(info: PluginInfo):
    """Import the entry point that listing found; a failure names the plugin, its distribution
    and version, and the exception that the import raised."""
    try:
        obj = info.entry_point.load()
    except Exception as exc:  # whatever a plugin's import raises must not become a traceback
        raise PluginError(f"{info.role} {info.name!r} from {info.origin} failed to import "
                          f"({info.value}): {type(exc).__name__}: {exc}") from exc
    # stevedore still answers "which one?": the loaded entry point is its group's only driver.
    extension = Extension(info.name, info.entry_point, obj, None)
    return DriverManager.make_test_instance(extension, namespace=_group(info.role)).driver


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
