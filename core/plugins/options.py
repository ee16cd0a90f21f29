"""Options that plugins declare: collected into typed config sections.

Each plugin that takes part in a run (core/plugins/objects.py) may return
``ConfigSection(name, cls)`` objects from ``plugtron_config_sections()``. Their fields become
``plugtron train`` flags under a heading naming the distribution, config-file keys, and
``config.<name>`` inside the run; the checkpoint's config keeps them under ``name``. A section
whose name or flags clash with the core's or another plugin's is skipped with a warning naming
both, so one badly written plugin cannot take the others' options away.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plugtron.core.config import SECTIONS, ConfigSection, ExtensibleSection, TrainConfig
from plugtron.core.config_flags import apply_values, flag_fields, section_flag_fields
from plugtron.core.errors import PlugtronError
from plugtron.core.plugins import registry
from plugtron.core.plugins.objects import PluginObject, call_declared, run_plugin_objects, warn_once
from plugtron.core.plugins.selection import AUTOLOAD_ENV, FLAGS, installed_selectors


@dataclass(frozen=True)
class DeclaredSection:
    section: ConfigSection
    plugin: PluginObject

    @property
    def heading(self) -> str:
        title = self.section.title or f"{self.plugin.role} {self.plugin.name}"
        return f"{title} ({self.plugin.origin})"


def collect_sections(config: TrainConfig, plugins: list[PluginObject] | None = None
                     ) -> list[DeclaredSection]:
    """The sections of every plugin that takes part in a run of ``config``."""
    plugins = run_plugin_objects(config) if plugins is None else plugins
    taken_flags = {spelling: "the core" for f in flag_fields()
                   for spelling in (f.flag, *f.aliases, f.negative) if spelling}
    taken_names = {name: "the core" for name in SECTIONS}
    out = []
    for plugin in plugins:
        try:
            declared = call_declared(plugin, "plugtron_config_sections") or []
            declared = list(declared)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the CLI
            warn_once(f"skipping the options of {plugin.label}: {type(exc).__name__}: {exc}")
            continue
        for section in declared:
            problem = _problem(section, plugin, taken_names, taken_flags)
            if problem:
                warn_once(f"skipping option section {getattr(section, 'name', section)!r} of "
                          f"{plugin.label}: {problem}")
                continue
            taken_names[section.name] = plugin.label
            for f in section_flag_fields(section.name, section.cls):
                for spelling in (f.flag, *f.aliases, f.negative):
                    if spelling:
                        taken_flags[spelling] = plugin.label
            out.append(DeclaredSection(section, plugin))
    return out


def _problem(section, plugin, taken_names, taken_flags) -> str | None:
    if not isinstance(section, ConfigSection):
        return f"expected a plugtron.api.ConfigSection, got {type(section).__name__}"
    if not dataclasses.is_dataclass(section.cls):
        return f"its class {section.cls!r} is not a dataclass"
    if not section.name.isidentifier():
        return "a section name must be a Python identifier"
    if section.name in taken_names:
        return f"the name is already used by {taken_names[section.name]}"
    if section.extends is not None:
        base = SECTIONS.get(section.extends)
        if base is None or not issubclass(base, ExtensibleSection):
            return f"it extends {section.extends!r}, which is not a core section that takes extensions"
        own = {f.name for f in dataclasses.fields(SECTIONS[section.extends])}
        clash = sorted(own & {f.name for f in dataclasses.fields(section.cls)})
        if clash:
            return f"its fields {', '.join(clash)} are already fields of {section.extends!r}"
    for f in section_flag_fields(section.name, section.cls):
        for spelling in (f.flag, *f.aliases, f.negative):
            if spelling and spelling in taken_flags:
                return f"flag {spelling} is already declared by {taken_flags[spelling]}"
    return None


def attach_sections(config: TrainConfig, declared: list[DeclaredSection]) -> TrainConfig:
    for item in declared:
        config.add_section(item.section.name, item.section.cls, item.section.extends)
    return config


def selector_sections() -> list[DeclaredSection]:
    """The sections of every installed selector: their flags decide which drivers (and so which
    other sections) a run has, so they are read before any other plugin's."""
    selectors = [PluginObject("selector", info.name, info.origin, cls)
                 for info, cls in installed_selectors()]
    return collect_sections(TrainConfig(), selectors)


def with_plugin_sections(config: TrainConfig) -> TrainConfig:
    """``config`` with the sections of the plugins its run selects attached (defaults)."""
    return attach_sections(config, collect_sections(config))


def config_from_dict(data: dict) -> TrainConfig:
    """A whole config from its dict form (``to_dict``, a checkpoint's config): the core
    sections first, which select the plugins, then the sections those plugins declare."""
    selectors = selector_sections()  # their values choose the drivers: read them first
    core_only = TrainConfig.from_dict(data, _classes(selectors))
    try:
        declared = collect_sections(core_only)
    except PlugtronError:
        declared = []  # e.g. a driver name that no longer resolves: the run reports it
    return TrainConfig.from_dict(data, _classes(declared))


def _classes(declared: list[DeclaredSection]) -> dict[str, type | tuple]:
    return {d.section.name: (d.section.cls, d.section.extends, d.section.formerly)
            for d in declared}


def config_from_flags(flags: dict, source: str = "settings") -> TrainConfig:
    """A whole config from ``{flag or field name: value}`` (dashes or underscores, short
    aliases such as ``tp``), including options of the plugins those settings select: the core's
    settings are applied first, then the selected plugins' sections are attached and their
    settings applied."""

    config = TrainConfig()
    attach_sections(config, selector_sections())  # their flags choose the drivers
    core_keys: set[str] = set()
    for f in flag_fields(config):
        core_keys.update(s.lstrip("-").replace("-", "_") for s in (f.flag, *f.aliases))
        core_keys.update((f.name, f"{f.section}.{f.name}"))
    norm = {k: str(k).lstrip("-").replace("-", "_") for k in flags}
    apply_values(config, {k: v for k, v in flags.items() if norm[k] in core_keys}, source)
    with_plugin_sections(config)
    apply_values(config, {k: v for k, v in flags.items() if norm[k] not in core_keys}, source)
    return config


#: The flag that selects a driver of each role, for messages.
SELECTING_FLAGS = {**FLAGS, "layer_backend": "--layer-backend"}


def owner_of_flag(flag: str, config: TrainConfig) -> str | None:
    """Which installed plugin declares ``flag`` although ``config`` does not collect its options
    (a driver it does not select, a disabled extension), said as what to do about it; None when
    no installed plugin declares it. Imports every installed driver: for error messages only."""
    taking_part = {(p.role, p.name) for p in run_plugin_objects(config)}
    candidates = [(role, info) for role in (*SELECTING_FLAGS, "extension")
                  for info in registry.available(role) if (role, info.name) not in taking_part]
    for role, info in candidates:
        try:
            obj = registry.load(role, info.name)
            obj = obj if role == "layer_backend" else registry.instantiate(obj)
            sections = call_declared(PluginObject(role, info.name, info.origin, obj),
                                     "plugtron_config_sections") or []
            flags = {spelling for section in sections
                     for f in section_flag_fields(section.name, section.cls)
                     for spelling in (f.flag, *f.aliases, f.negative) if spelling}
        except Exception:  # noqa: BLE001 - a broken plugin cannot own the flag
            continue
        if flag not in flags:
            continue
        what = f"{role} {info.name!r} ({info.origin})"
        if role == "extension":
            return (f"{flag} is an option of {what}, which this run does not load "
                    f"(disabled with -p no:{info.name}, or {AUTOLOAD_ENV} is set)")
        return (f"{flag} is an option of {what}, which this run does not select: add "
                f"{SELECTING_FLAGS[role]} {info.name}")
    return None
