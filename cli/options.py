"""The ``train``/``evaluate`` flags, generated from the config sections: the core's and those the
run's plugins declare (one list for the CLI, config files and docs).

Which plugins take part depends on flags such as ``--model`` and ``--pp``, so the command line
(and the config file it names) is scanned for those first (:func:`prescan`); the command is then
built with the options of exactly those plugins, each plugin's under a heading naming its
distribution.
"""

from __future__ import annotations

from typing import Any

import click
from plugtron.core.config import SECTIONS, TrainConfig
from plugtron.core.config_flags import (
    FlagField,
    apply_values,
    flag_fields,
    load_config_file,
    section_flag_fields,
)
from plugtron.core.errors import ConfigError, PlugtronError
from plugtron.core.plugins.selection import selected_driver

#: Core sections whose values select plugins (or the schedule through pp/vp).
SELECTING_SECTIONS = ("plugins", "parallel")

CORE_HEADINGS = {
    "model": "Model", "parallel": "Parallelism", "training": "Training", "data": "Data",
    "plugins": "Plugins", "checkpoint": "Checkpoints", "logging": "Logging",
}


def _param_name(section: str, name: str) -> str:
    return f"{section}__{name}"


# --------------------------------------------------------------------------- prescan


def expand_data_paths(args: list[str]) -> list[str]:
    """Megatron's ``--data-path 0.3 A 0.7 B`` (several values after one flag) as the repeated
    flags click reads: ``--data-path 0.3 --data-path A ...``. Applies to ``--data-path`` and
    ``--{train,valid,test}-data-path``; values run up to the next argument starting with ``-``."""
    out, flag = [], None
    for arg in args:
        if arg.startswith("-"):
            flag = arg if arg.endswith("data-path") and "=" not in arg else None
            if flag is None:
                out.append(arg)
            continue
        if flag is not None:
            out += [flag, arg]
            continue
        out.append(arg)
    return out


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def expand_several_values(args: list[str], several: set[str]) -> list[str]:
    """Megatron's nargs='+' for the list settings: ``--flag A B`` (several values after one
    flag, ``several`` holds their spellings) as the repeated flags click reads, ``--flag A
    --flag B``. Values run up to the next argument starting with ``-`` that is not a
    number."""
    out: list[str] = []
    flag, first = None, False
    for arg in args:
        if arg.startswith("-") and not _is_number(arg):
            flag, first = (arg if arg in several else None), True
            out.append(arg)
            continue
        if flag is not None and not first:
            out.append(flag)
        first = False
        out.append(arg)
    return out


def _spellings(flags: list[FlagField]) -> dict[str, FlagField]:
    out = {}
    for flag in flags:
        for spelling in (flag.flag, *flag.aliases):
            out[spelling] = flag
        if flag.negative:
            out[flag.negative] = flag
    return out


def prescan(args: list[str], base: TrainConfig | None = None) -> TrainConfig:
    """A core-only config holding what selects the plugins: ``base`` (e.g. a checkpoint's
    config), then the ``--config`` file, then the flags. Anything unparsable is left for the
    real parse to report."""
    from plugtron.core.plugins.options import attach_sections, selector_sections

    config = base if base is not None else TrainConfig()
    selectors = selector_sections()  # their flags choose drivers too (--use-torch-fsdp2)
    attach_sections(config, selectors)
    sections = {*SELECTING_SECTIONS, *(d.section.name for d in selectors)}
    selecting = [f for f in flag_fields(config) if f.section in sections]
    by_spelling = _spellings(selecting)
    args = expand_several_values(list(args), {s for s, f in by_spelling.items()
                                              if f.type is list and not f.is_flag})
    given: dict[str, Any] = {}  # a flag's value: a bool, a string or a list of them
    config_file = None
    i = 0
    while i < len(args):
        arg = args[i]
        name, _, inline = arg.partition("=")
        if name == "--config":
            config_file = inline or (args[i + 1] if i + 1 < len(args) else None)
        flag = by_spelling.get(name)
        if flag is not None:
            if flag.is_flag:
                given[flag.name] = name != flag.negative
            elif inline or i + 1 < len(args):
                value = inline or args[i + 1]
                if flag.type is list:
                    given.setdefault(flag.name, []).append(value)
                else:
                    given[flag.name] = value
        i += 1
    try:
        if config_file:
            from_file = load_config_file(config_file)
            keys = {s.lstrip("-").replace("-", "_") for f in selecting
                    for s in (f.flag, *f.aliases)} | {f.name for f in selecting}
            apply_values(config, {k: v for k, v in from_file.items()
                                  if str(k).replace("-", "_") in keys}, "config file")
        apply_values(config, given, "command line")
    except PlugtronError:
        pass
    return config


def declared_sections(config: TrainConfig) -> list:
    """The plugin sections of a run of ``config`` (broken plugins skipped with a warning)."""
    from plugtron.core.plugins.options import collect_sections

    try:
        return collect_sections(config)
    except PlugtronError:
        return []  # e.g. an unknown --model: the real parse reports it


def model_presets(config: TrainConfig) -> dict:
    """The selected model plugin's presets (``model_presets``), or none."""
    from plugtron.core.plugins import registry
    from plugtron.core.plugins.objects import PluginObject, call_declared

    try:
        obj = registry.instantiate(registry.load("model", selected_driver(config, "model")))
    except PlugtronError:
        return {}
    presets = call_declared(PluginObject("model", selected_driver(config, "model"), "?", obj),
                            "model_presets")
    return dict(presets or {})


# --------------------------------------------------------------------------- options


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists options under their section's heading."""

    def __init__(self, *args, headings: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.headings = headings or {}

    def parse_args(self, ctx, args):
        given = list(args)  # click's parser consumes the list
        if not any(isinstance(p, click.Argument) for p in self.params):
            # A list setting takes several values after one flag, as Megatron's nargs.
            several = {spelling for p in self.params
                       if isinstance(p, click.Option) and p.multiple and not p.is_flag
                       for spelling in p.opts}
            args = expand_several_values(list(args), several)
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            # A plugin's option whose plugin this run does not select: say whose it is.
            from plugtron.core.plugins.options import owner_of_flag

            owner = owner_of_flag(exc.option_name, prescan(given))
            if owner is None:
                raise
            raise click.UsageError(f"No such option: {exc.option_name}: {owner}.",
                                   ctx=ctx) from None

    def format_options(self, ctx, formatter):
        groups: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            section = (param.name or "").split("__")[0] if "__" in (param.name or "") else ""
            heading = self.headings.get(section) or CORE_HEADINGS.get(section) or "Options"
            groups.setdefault(heading, []).append(record)
        for heading, records in groups.items():
            with formatter.section(heading):
                formatter.write_dl(records)


def _option(flag: FlagField):
    dest = _param_name(flag.section, flag.name)
    if flag.is_flag:
        if flag.negative:
            return click.option(f"{flag.flag}/{flag.negative}", *flag.aliases, dest,
                                default=None, help=flag.help)
        return click.option(flag.flag, *flag.aliases, dest, is_flag=True, flag_value=True,
                            default=None, help=flag.help)
    kind = click.Choice(flag.choices) if flag.choices else {
        int: int, float: float, list: str}.get(flag.type, str)
    return click.option(flag.flag, *flag.aliases, dest, type=kind, default=None,
                        multiple=flag.type is list, show_default=False,
                        help=f"{flag.help} [default: {flag.default}]")


def option_fields(declared: list) -> list[FlagField]:
    """The core's fields, then each declared plugin section's."""
    out = flag_fields()
    for item in declared:
        out += section_flag_fields(item.section.name, item.section.cls)
    return out


def config_options(declared: list):
    """Decorate a click command with one option per field of every section."""

    def decorate(func):
        for flag in reversed(option_fields(declared)):
            func = _option(flag)(func)
        return func

    return decorate


def headings(declared: list) -> dict[str, str]:
    return {item.section.name: item.heading for item in declared}


def build_config(params: dict, config_file: str | None, preset: str | None,
                 base: TrainConfig | None = None, declared: list | None = None,
                 presets: dict | None = None) -> TrainConfig:
    """dataclass defaults (or ``base``) < preset < config file < flags. ``declared``: the
    plugin sections (default: those of the plugins ``base`` or the defaults select)."""
    config = base if base is not None else TrainConfig()
    if declared is None:
        declared = declared_sections(config)
    for item in declared:
        config.add_section(item.section.name, item.section.cls, item.section.extends)
    if preset:
        presets = model_presets(config) if presets is None else presets
        if preset not in presets:
            from plugtron.core.plugins import registry

            # the model the flags select (they apply after the preset); one that does not
            # load is the real error
            model = params.get(_param_name("plugins", "model")) or "auto"
            if model == "auto":
                model = selected_driver(config, "model")
            registry.load("model", model)
            raise ConfigError(f"--preset {preset!r} is not a preset of model {model!r}; its "
                              f"presets: {', '.join(sorted(presets)) or 'none'}")
        apply_values(config, presets[preset], f"preset {preset!r}")
    if config_file:
        apply_values(config, load_config_file(config_file), f"config file {config_file!r}")
    given = {}
    for flag in flag_fields(config):
        value = params.get(_param_name(flag.section, flag.name))
        if value is None or (flag.type is list and len(value) == 0):
            continue
        given[f"{flag.section}.{flag.name}"] = (flag, list(value) if flag.type is list
                                                else value)
    for flag, value in given.values():
        apply_values(config, {flag.flag: value}, "command line")
    return config


__all__ = ["SECTIONS", "SectionedCommand", "build_config", "config_options",
           "declared_sections", "expand_several_values", "headings", "model_presets", "prescan"]
