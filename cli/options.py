"""The ``train`` flags, generated from the config dataclasses (one list for CLI, config files
and docs)."""

from __future__ import annotations

import click
from plugtron.core.config import TrainConfig, apply_values, flag_fields, load_config_file
from plugtron.core.presets import PRESETS


def _param_name(section: str, name: str) -> str:
    return f"{section}__{name}"


def config_options(func):
    """Decorate a click command with one option per config field."""
    for flag in reversed(flag_fields()):
        dest = _param_name(flag.section, flag.name)
        if flag.is_flag:
            if flag.negative:
                func = click.option(f"{flag.flag}/{flag.negative}", *flag.aliases, dest,
                                    default=None, help=flag.help)(func)
            else:
                func = click.option(flag.flag, *flag.aliases, dest, is_flag=True,
                                    flag_value=True, default=None, help=flag.help)(func)
            continue
        kind = click.Choice(flag.choices) if flag.choices else {
            int: int, float: float, list: str}.get(flag.type, str)
        func = click.option(flag.flag, *flag.aliases, dest, type=kind, default=None,
                            multiple=flag.type is list, show_default=False,
                            help=f"{flag.help} [default: {flag.default}]")(func)
    return func


def build_config(params: dict, config_file: str | None, preset: str | None,
                 base: TrainConfig | None = None) -> TrainConfig:
    """dataclass defaults (or ``base``) < preset < config file < flags."""
    config = base if base is not None else TrainConfig()
    if preset:
        apply_values(config, PRESETS[preset], f"preset {preset!r}")
    if config_file:
        apply_values(config, load_config_file(config_file), f"config file {config_file!r}")
    given = {}
    for flag in flag_fields():
        value = params.get(_param_name(flag.section, flag.name))
        if value is None or (flag.type is list and len(value) == 0):
            continue
        given[flag.name] = list(value) if flag.type is list else value
    apply_values(config, given, "command line")
    return config


def extension_options() -> list:
    """Options declared by installed extension plugins. A broken extension is reported when a
    run starts, not while building the CLI."""
    from plugtron.core.errors import PluginError
    from plugtron.core.plugin_manager import load_extensions, new_plugin_manager

    pm = new_plugin_manager()
    try:
        load_extensions(pm, set())
    except PluginError:
        return []
    return [option for options in pm.hook.plugtron_options() for option in options]


def extra_options(options: list):
    """Decorate a click command with the extension options (dest ``extra__<name>``)."""

    def decorate(func):
        for option in reversed(options):
            dest = "extra__" + option.name.replace("-", "_")
            if option.is_flag:
                func = click.option(f"--{option.name}", dest, is_flag=True, default=None,
                                    help=option.help)(func)
            else:
                func = click.option(f"--{option.name}", dest, type=option.type, default=None,
                                    help=f"{option.help} [default: {option.default}]")(func)
        return func

    return decorate


def apply_extra(config: TrainConfig, options: list, params: dict) -> None:
    for option in options:
        value = params.get("extra__" + option.name.replace("-", "_"))
        config.extra[option.name] = option.default if value is None else value
