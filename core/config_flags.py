"""How settings reach a :class:`~plugtron.core.config.TrainConfig`: every section field that
carries a flag (:func:`flag_fields`), the typing of a value as the CLI would type it, and
:func:`apply_values` for flags, config files (:func:`load_config_file`) and presets."""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Any

import yaml
from plugtron.core.config import SECTIONS, TrainConfig
from plugtron.core.errors import ConfigError


@dataclass(frozen=True)
class FlagField:
    """One user-settable field: where it lives and how it is spelled on the command line."""

    section: str
    name: str
    flag: str
    aliases: tuple
    help: str
    choices: tuple | None
    is_flag: bool
    negative: str | None
    type: Any
    default: Any


def _field_type(f: dataclasses.Field) -> Any:
    """bool, int, float, str or list, from an annotation written as a string (``from __future__
    import annotations``) or as a type (``int | None``, ``list[str]``)."""
    annotation = f.type
    if not isinstance(annotation, str):
        args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
        origin = getattr(annotation, "__origin__", None)
        if origin is list or annotation is list:
            return list
        if isinstance(annotation, type) and annotation in (bool, int, float, str):
            return annotation
        if args and isinstance(args[0], type) and args[0] in (bool, int, float, str, list):
            return args[0]
        annotation = str(annotation)
    if annotation.startswith("list"):
        return list
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if annotation.startswith(name):
            return typ
    return str


def section_flag_fields(section: str, cls: type) -> list[FlagField]:
    """The settable fields of one section class, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "flag" not in meta:
            continue
        default = f.default
        if default is dataclasses.MISSING:  # then it has a factory
            default = f.default_factory()  # type: ignore[misc,operator]
        out.append(FlagField(section, f.name, meta["flag"], tuple(meta["aliases"]),
                             meta["help"], meta["choices"], meta["is_flag"],
                             meta["negative"], _field_type(f), default))
    return out


def flag_fields(config: "TrainConfig | None" = None) -> list[FlagField]:
    """Every settable field of the core's sections and of ``config``'s plugin sections."""
    out = []
    classes = dict(SECTIONS)
    if config is not None:
        classes.update({name: type(value) for name, value in config.plugin_sections.items()})
    for section, cls in classes.items():
        out += section_flag_fields(section, cls)
    return out


def _coerce(flag: FlagField, value: Any, source: str) -> Any:
    if value is None:
        return None
    try:
        if flag.type is bool:
            if isinstance(value, str):
                lowered = value.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return lowered in ("true", "1", "yes")
            return bool(value)
        if flag.type is list:
            return list(value) if isinstance(value, (list, tuple)) else [value]
        if flag.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return flag.type(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {flag.flag} must be of type {flag.type.__name__}, "
                          f"got {value!r}") from None


def _setting_keys(config: TrainConfig):
    """How a settings key names a field: ``bare`` core field names, ``spelled`` flag names
    (unique over the core and the plugins), ``sectioned`` ``(section, field or flag name)``.

    A plugin field's bare name is not a key: a plugin section may hold a field named like a
    core one (``seed``), and a bare ``seed`` must keep meaning the core's; the plugin's field is
    set by its flag name or as ``section.field``. The fields of a section that extends a core
    one are that section's own: bare, and ``<core section>.field`` too."""
    bare, spelled, sectioned = {}, {}, {}
    for flag in flag_fields(config):
        names = [s.lstrip("-").replace("-", "_") for s in (flag.flag, *flag.aliases)]
        extends = None if flag.section in SECTIONS else config.extended_section(flag.section)
        for name in names:
            spelled[name] = flag
        for name in (*names, flag.name):
            sectioned[(flag.section, name)] = flag
            if extends is not None:  # an extension's fields read as the core section's own
                sectioned[(extends, name)] = flag
        if flag.section in SECTIONS or extends is not None:
            bare[flag.name] = flag
    return bare, spelled, sectioned


def apply_values(config: TrainConfig, values: dict, source: str) -> None:
    """Set fields from ``{key: value}`` where a key is a flag name (dashes or underscores), a core
    field name, or ``section.field`` (any section's, a plugin's too)."""
    bare, spelled, sectioned = _setting_keys(config)
    sections = {section for section, _ in sectioned}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if "." in name:
            section, _, rest = name.partition(".")
            flag = sectioned.get((section, rest))
            if flag is None and section not in sections:  # a grouping of the user's own
                flag = bare.get(rest) or spelled.get(rest)
        else:
            flag = bare.get(name) or spelled.get(name)
        if flag is None:
            owners = [f"{s}.{n}" for s, n in sectioned if n == name and s not in SECTIONS]
            hint = f" (a plugin's field: write {' or '.join(owners)})" if owners else ""
            raise ConfigError(f"{source}: unknown setting {key!r}{hint}; run `plugtron train "
                              f"--help` for the settings that exist")
        value = _coerce(flag, value, source)
        # A list field with choices (several values after one flag) checks each value.
        for one in (value if isinstance(value, list) else [value]):
            if flag.choices and one is not None and one not in flag.choices:
                raise ConfigError(f"{source}: {flag.flag} {one!r} is not one of "
                                  f"{', '.join(flag.choices)}")
        setattr(getattr(config, flag.section), flag.name, value)


def load_config_file(path: str) -> dict:
    """Read a flat YAML or TOML config file into ``{key: value}``; sections are flattened."""

    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    text = file.read_text()
    try:
        if file.suffix == ".toml":
            import tomllib  # noqa: PLC0415 - Python 3.11+: only a TOML config file needs it
            data = tomllib.loads(text)
        else:

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # a parse error is the user's to fix
        raise ConfigError(f"config file {path!r} could not be parsed: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of settings")
    flat = {}
    for key, value in data.items():
        # A mapping is a section (the core's or a plugin's): options themselves are scalars.
        # A plugin section's keys stay qualified (``hybrid.state_dim``): bare field names are
        # the core's (apply_values).
        if isinstance(value, dict):
            flat.update({(k if key in SECTIONS else f"{key}.{k}"): v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


# --------------------------------------------------------------------------- derived values
