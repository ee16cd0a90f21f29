"""Which plugin? The stevedore side of plugtron: one entry-point group per swappable role.

Listing reads entry-point metadata only, so an uninstalled or broken plugin costs nothing until a
run selects it. Loading imports exactly the ``importlib.metadata`` entry point that listing found
and hands it to stevedore as the one driver of its group. stevedore's own entry-point scan is
never used: its cache (in memory and on disk) is keyed by directory mtimes packed into 32-bit
floats, about two minutes of resolution, so a plugin re-installed with a new entry point would
be listed here but "not found" there.

Reading every installed distribution's entry points takes tens of milliseconds, and one run's
set-up asks a hundred times; the answer is kept while nothing it was read from changed: the
import path, its directories' mtimes and each distribution's ``entry_points.txt`` (a few hundred
``stat`` calls, well under a millisecond each time). An install, an uninstall, a re-install or a
rewritten ``entry_points.txt`` changes one of them, so listing and loading still see it at once.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata as metadata
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from plugtron.core.errors import PluginError
from stevedore import DriverManager
from stevedore.extension import Extension


@dataclass(frozen=True)
class PluginRole:
    """A swappable role: its entry-point group and how the core treats its plugins.

    The core declares its own roles here; a distribution adds one of its own (plugtron-moe's
    token dispatchers) with an entry point in group ``plugtron.roles`` whose name is the role's
    name and whose object is a ``PluginRole``, the way pytest plugins add hooks with
    ``pytest_addhooks``. The core then lists, loads and checks that role's plugins like its own.
    """

    group: str
    description: str = ""
    #: Every installed plugin of the role takes part in option collection and validation (like
    #: layer types), not only one a run selects.
    always_collected: bool = False
    #: ``plugtron plugin new ROLE NAME`` writes a package from this template: ``"package:folder"``,
    #: a folder of the declaring package's data with ``*.tmpl`` files (``plugin.py.tmpl`` becomes
    #: the plugin module; the core's ``common`` files are added), rendered like the core's
    #: templates. Empty: the role has no template.
    template: str = ""
    #: Distributions the generated package's tests need besides plugtron and pytest.
    template_test_requires: tuple[str, ...] = ()


#: The core's roles. The role is what error messages and the CLI call it.
CORE_ROLES: dict[str, PluginRole] = {
    "model": PluginRole("plugtron.models", "builds one pipeline stage, forward_step, loss_func"),
    "schedule": PluginRole("plugtron.schedules", "the pipeline schedule"),
    "optimizer": PluginRole("plugtron.optimizers", "builds the optimizer"),
    "data_parallel": PluginRole("plugtron.data_parallel",
                                "wraps each model chunk for data parallelism"),
    "layer_backend": PluginRole("plugtron.layer_backends", "tensor-parallel building blocks"),
    "layer": PluginRole("plugtron.layers", "decoder layer types by symbol", always_collected=True),
    "dataset": PluginRole("plugtron.datasets", "dataset providers"),
    "tokenizer": PluginRole("plugtron.tokenizers", "--tokenizer-type"),
    "converter": PluginRole("plugtron.converters", "HF / Megatron mapping of one model"),
    "extension": PluginRole("plugtron", "lifecycle hooks and wrappers"),
    "model_transform": PluginRole("plugtron.model_transforms",
                                  "changes every built model chunk (adds, freezes, swaps modules)",
                                  always_collected=True),
    "selector": PluginRole("plugtron.selectors",
                           "answers `auto` and Megatron-style flags with a driver's name",
                           always_collected=True),
}
#: role -> entry-point group of the core's roles.
GROUPS: dict[str, str] = {role: r.group for role, r in CORE_ROLES.items()}
#: The group in which distributions declare roles of their own.
ROLES_GROUP = "plugtron.roles"

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(f"plugtron: warning: {message}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=None)
def _declared_role(name: str, value: str, ep: metadata.EntryPoint) -> PluginRole | None:
    try:
        role = ep.load()
    except Exception as exc:  # noqa: BLE001 - a broken declaration must not break the others
        _warn_once(f"skipping plugin role {name!r} ({value}): {type(exc).__name__}: {exc}")
        return None
    if not isinstance(role, PluginRole):
        _warn_once(f"skipping plugin role {name!r} ({value}): not a PluginRole")
        return None
    return role


_METADATA_DIRS = (".dist-info", ".egg-info")


#: path entry -> (its mtime, the metadata directories in it): listed again when the mtime moves.
_listings: dict[str, tuple[int, tuple[str, ...]]] = {}


def _metadata_dirs(entry: str, mtime_ns: int) -> tuple[str, ...]:
    listed = _listings.get(entry)
    if listed is None or listed[0] != mtime_ns:
        with os.scandir(entry) as children:
            names = tuple(sorted(c.name for c in children if c.name.endswith(_METADATA_DIRS)))
        listed = _listings[entry] = (mtime_ns, names)
    return listed[1]


def _installed_state() -> tuple:
    """What the installed entry points are read from: the import path and its finders, each
    path directory's mtime, and each distribution's ``entry_points.txt`` (mtime, size, inode)."""
    parts: list = [tuple(sys.path), tuple(id(finder) for finder in sys.meta_path)]
    for entry in sys.path:
        # Relative entries ("" is the working directory) name another place after a chdir.
        entry = os.path.abspath(entry or ".")
        try:
            mtime_ns = os.stat(entry).st_mtime_ns
            names = _metadata_dirs(entry, mtime_ns)
        except OSError:  # a missing directory, a zip file: nothing that can change under us
            continue
        parts.append(mtime_ns)
        for name in names:
            try:
                st = os.stat(os.path.join(entry, name, "entry_points.txt"))
                parts.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                parts.append((name, None))
    return tuple(parts)


@dataclass
class _Installed:
    """The installed entry points as read at one ``_installed_state()``, and what was derived
    from them (declared roles, each role's listing)."""

    state: tuple
    #: ``EntryPoints`` (Python 3.12+) or ``SelectableGroups`` (3.10, 3.11): both ``select()``.
    entry_points: Any
    roles: dict[str, PluginRole] | None = None
    infos: dict[str, tuple[PluginInfo, ...]] = field(default_factory=dict)


_installed: _Installed | None = None


def snapshot() -> object:
    """A token that stays the same object while nothing installed changed: a cache of
    something derived from the entry points compares it by identity."""
    return _current()


def _current() -> _Installed:
    """The installed entry points, read again only when something they come from changed."""
    global _installed
    state = _installed_state()
    if _installed is None or _installed.state != state:
        _installed = _Installed(state, metadata.entry_points())
    return _installed


def _declared_roles(installed: _Installed) -> dict[str, PluginRole]:
    if installed.roles is None:
        out = dict(CORE_ROLES)
        for ep in installed.entry_points.select(group=ROLES_GROUP):
            if ep.name not in out:
                role = _declared_role(ep.name, ep.value, ep)
                if role is not None:
                    out[ep.name] = role
        installed.roles = out
    return installed.roles


def roles() -> dict[str, PluginRole]:
    """The core's roles, then those installed distributions declare (group ``plugtron.roles``;
    a name the core already has is ignored)."""
    return dict(_declared_roles(_current()))


def groups() -> dict[str, str]:
    """role -> entry-point group, declared roles included."""
    return {role: r.group for role, r in roles().items()}


def always_collected_roles() -> list[str]:
    """Roles every installed plugin of which takes part in options and validation."""
    return [role for role, r in roles().items() if r.always_collected]


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


def _group(role: str, installed: _Installed | None = None) -> str:
    known = _declared_roles(installed or _current())
    try:
        return known[role].group
    except KeyError:
        raise PluginError(f"unknown plugin role {role!r}; roles: {', '.join(known)}") from None


def available(role: str) -> list[PluginInfo]:
    """Every entry point of a role, sorted by name, read from metadata without importing."""
    installed = _current()
    if role not in installed.infos:
        infos = []
        for ep in installed.entry_points.select(group=_group(role, installed)):
            dist = getattr(ep, "dist", None)
            infos.append(PluginInfo(role, ep.name, ep.value,
                                    dist.metadata["Name"] if dist else "?",
                                    dist.version if dist else "?", ep))
        installed.infos[role] = tuple(sorted(infos, key=lambda i: (i.name, i.distribution)))
    return list(installed.infos[role])


class UnknownPluginError(PluginError):
    """No installed plugin of the role has that name (the message lists those that do)."""


def did_you_mean(name: str, names: list[str]) -> str:
    """``" (did you mean 'x'?)"`` for the nearest of ``names``, or ``""``."""
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


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
        raise UnknownPluginError(f"unknown {role} {name!r}"
                                 f"{did_you_mean(name, [i.name for i in available(role)])}; "
                                 f"{describe_available(role)}")
    if len(matches) > 1:
        raise PluginError(f"{role} {name!r} is registered by more than one distribution: "
                          + ", ".join(m.origin for m in matches) + "; uninstall all but one")
    return load_entry_point(matches[0])


def unmet_requirements(info: PluginInfo) -> list[str]:
    """The distributions that ``info``'s distribution requires (its ``Requires-Dist`` without
    an ``extra`` marker) and that are not installed: a plugin that works only beside another
    distribution says so in its metadata, and is reported here instead of failing later."""
    return list(_unmet(info.distribution, info.version))


@functools.lru_cache(maxsize=64)
def _unmet(distribution: str, version: str) -> tuple[str, ...]:
    # Once per distribution and version in a process: loads happen a hundred times in a run's
    # set-up, and re-reading what is installed costs about a millisecond each time.
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return ()
    missing = []
    for requirement in dist.requires or []:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker:
            continue
        name = re.split(r"[\s\[<>=!~(]", spec.strip(), maxsplit=1)[0]
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(spec.strip())
    return tuple(missing)


def load_entry_point(info: PluginInfo):
    """Import the entry point that listing found; a failure names the plugin, its distribution
    and version, and the exception that the import raised. A distribution whose requirements
    are not installed is refused first, naming them."""
    missing = unmet_requirements(info)
    if missing:
        raise PluginError(f"{info.role} {info.name!r} from {info.origin} needs "
                          f"{', '.join(missing)}, which is not installed: "
                          f"pip install {' '.join(m.split()[0] for m in missing)}")
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
