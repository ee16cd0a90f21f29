"""``plugtron plugin new KIND NAME [DIR]``: write a plugin package that installs and passes its
own tests as generated.

The templates are package data (``cli/templates/<kind>/``, shipped in the wheel). A role that an
installed distribution declares (``plugtron.roles``) brings its own template in its own package
data (``PluginRole.template``, e.g. plugtron-moe's ``moe_dispatcher``) and becomes a KIND here.
Every file is rendered in memory first and written only when all of them rendered, so a refused
or broken call leaves nothing behind.
"""

from __future__ import annotations

import keyword
import pathlib
import re
from dataclasses import dataclass
from importlib import resources
from string import Template

import click
from plugtron.core.config import SECTIONS, TrainConfig
from plugtron.core.config_flags import flag_fields
from plugtron.core.plugins import registry

from .errors import UserError

#: The core's kinds (each also its registry role) -> entry-point group; kinds() adds the roles
#: installed distributions declare with a template.
KINDS = {
    "model": "plugtron.models",
    "schedule": "plugtron.schedules",
    "optimizer": "plugtron.optimizers",
    "data_parallel": "plugtron.data_parallel",
    "dataset": "plugtron.datasets",
    "layer": "plugtron.layers",
    "extension": "plugtron",
    "model_transform": "plugtron.model_transforms",
}
#: Shorter spellings of a KIND.
KIND_ALIASES = {"transform": "model_transform"}

#: Kinds whose generated tests train the ``gpt`` model, so they need plugtron-gpt to run.
NEEDS_GPT = {"schedule", "optimizer", "data_parallel", "dataset", "extension", "model_transform"}



def kinds() -> dict[str, str]:
    """Every kind ``plugin new`` writes -> its entry-point group: the core's, then each role an
    installed distribution declares with a template."""
    out = dict(KINDS)
    for role, declared in registry.roles().items():
        if declared.template and role not in out:
            out[role] = declared.group
    return out


def check_kind(kind: str) -> str:
    kind = KIND_ALIASES.get(kind, kind)
    known = kinds()
    if kind not in known:
        raise UserError(f"unknown KIND {kind!r}; plugtron plugin new writes: "
                        f"{', '.join(sorted(known))}")
    return kind


#: One-character symbols a layer type may not take: the built-in ones and ``|`` (the pipeline
#: split in layer patterns).
RESERVED_SYMBOLS = {"*", "-", "M", "E", "|"}
DEFAULT_SYMBOL = "G"

NAME_RULE = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
TEMPLATE_SUFFIX = ".tmpl"
#: The template file that becomes the plugin module ``<module>.py``.
PLUGIN_TEMPLATE = "plugin.py" + TEMPLATE_SUFFIX


@dataclass(frozen=True)
class Names:
    """Every spelling of NAME a template uses."""

    name: str  # entry-point name: --model NAME, -p no:NAME
    dist: str  # distribution: plugtron-NAME
    module: str  # Python module: plugtron_NAME (prefixed, so it never shadows another module)
    cls: str  # CamelCase of NAME, the start of the module's class names
    plugin: str  # the class the entry point names: <cls>Plugin, <cls>Layer for a layer type
    section: str  # config section: config.<section>
    flag: str  # option prefix: --NAME

    @classmethod
    def of(cls, kind: str, name: str) -> Names:
        snake = name.replace("-", "_")
        camel = "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_]", name))
        # A suffix keeps the entry-point class apart from the template's own names (Lion).
        plugin = camel + ("Layer" if kind == "layer" else "Plugin")
        return cls(name=name, dist=f"plugtron-{name.replace('_', '-')}",
                   module=f"plugtron_{snake}", cls=camel, plugin=plugin, section=snake,
                   flag=f"--{name}")


def check_name(kind: str, name: str) -> Names:
    """NAME is an entry-point name, and with ``-`` as ``_`` a Python name for the module and
    the config section, that no installed plugin of KIND and no core section uses."""
    if not NAME_RULE.fullmatch(name):
        raise UserError(
            f"NAME {name!r} is not a valid plugin name: use lowercase letters and digits, "
            f"starting with a letter, with single '-' or '_' between words (e.g. my-{kind}); "
            f"it becomes the entry-point name, and with '-' as '_' the Python module "
            f"plugtron_<name> and the config section config.<name>")
    names = Names.of(kind, name)
    if keyword.iskeyword(names.section):
        raise UserError(f"NAME {name!r} is a Python keyword: config.{names.section} would not "
                        f"parse; choose another")
    if names.section in {*SECTIONS, "plugin_sections", *dir(TrainConfig)}:
        raise UserError(f"NAME {name!r}: config.{names.section} is the core's; choose another")
    group = kinds()[kind]
    taken = [info for info in registry.available(kind) if info.name == name]
    if taken:
        raise UserError(f"a {kind} named {name!r} is already installed ({taken[0].origin}, "
                        f"group {group}); two would make the name ambiguous: choose another "
                        f"NAME or uninstall that one")
    return names


def check_symbol(kind: str, symbol: str | None) -> str:
    if symbol is None:
        return DEFAULT_SYMBOL
    if kind != "layer":
        raise UserError("--symbol is for layer plugins only")
    if len(symbol) != 1 or symbol.isspace() or symbol in RESERVED_SYMBOLS:
        raise UserError(f"--symbol {symbol!r} must be one character other than whitespace and "
                        f"{' '.join(sorted(RESERVED_SYMBOLS))} (taken by built-in layer types "
                        f"or the pipeline split)")
    return symbol


def template_values(kind: str, names: Names, symbol: str) -> dict[str, str]:
    group = kinds()[kind]
    needs: tuple[str, ...]
    if kind in KINDS:
        needs = ("plugtron-gpt",) if kind in NEEDS_GPT else ()
    else:
        needs = registry.roles()[kind].template_test_requires
    test_requires = ['"pytest>=8"'] + [f'"{dist}"' for dist in needs]
    return {**vars(names), "kind": kind, "group": group, "symbol": symbol,
            "test_requires": ", ".join(test_requires)}


def _template_files(kind: str):
    """(relative output path, template text) of every file of KIND, common ones included."""
    root = resources.files(__package__) / "templates"
    yield from _walk(root / "common", "")
    if kind in KINDS:
        yield from _walk(root / kind, "")
    else:  # a declared role's template: "package:folder" of that package's data
        package, _, folder = registry.roles()[kind].template.partition(":")
        yield from _walk(resources.files(package).joinpath(*folder.split("/")), "")


def _walk(folder, prefix: str):
    for child in folder.iterdir():
        if child.is_dir():
            yield from _walk(child, f"{prefix}{child.name}/")
        elif child.name.endswith(TEMPLATE_SUFFIX):
            yield prefix + child.name, child.read_text(encoding="utf-8")


def render(kind: str, names: Names, symbol: str = DEFAULT_SYMBOL) -> dict[str, str]:
    """Every file of the package: relative path -> contents."""
    values = template_values(kind, names, symbol)
    files = {}
    for path, text in _template_files(kind):
        out = f"{names.module}.py" if path == PLUGIN_TEMPLATE else path[:-len(TEMPLATE_SUFFIX)]
        files[out] = Template(text).substitute(values)
    return files


def check_options(kind: str, names: Names) -> None:
    """The options the plugin will declare (every ``"${flag}..."`` in its template) must not
    be plugtron's own, such as ``--lr``: the core would skip the plugin's whole section."""
    template = dict(_template_files(kind))[PLUGIN_TEMPLATE]
    declared = {names.flag + suffix for suffix in re.findall(r'"\$\{flag\}([a-z0-9-]*)"', template)}
    core = {s for f in flag_fields() for s in (f.flag, *f.aliases, f.negative) if s}
    clash = sorted(declared & core)
    if clash:
        raise UserError(f"NAME {names.name!r} gives the plugin the option(s) "
                        f"{', '.join(clash)}, which plugtron already has; choose another NAME")


def write_package(directory: pathlib.Path, files: dict[str, str]) -> None:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UserError(f"{directory} exists and is not an empty directory; nothing written "
                        f"(give another DIR, or remove it first)")
    for path, text in files.items():
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


@click.group()
def plugin():
    """Start a plugin of your own."""


@plugin.command("new")
@click.argument("kind")
@click.argument("name")
@click.argument("directory", metavar="[DIR]", required=False, type=click.Path(path_type=pathlib.Path))
@click.option("--symbol", default=None,
              help=f"Layer plugins: the one-character symbol of the layer type (default "
                   f"{DEFAULT_SYMBOL}).")
def new(kind, name, directory, symbol):
    """Write a package for a KIND plugin called NAME into DIR (default ./plugtron-NAME): its
    pyproject.toml with the entry point, the plugin module, a README and tests that use
    plugtron.testing. It installs (pip install -e DIR) and passes its tests as generated.

    KIND: model, schedule, optimizer, data_parallel, dataset, layer, extension,
    model_transform (or transform), or a role an installed distribution declares with a
    template (moe_dispatcher, with plugtron-moe)."""
    kind = check_kind(kind)
    names = check_name(kind, name)
    symbol = check_symbol(kind, symbol)
    directory = directory or pathlib.Path(names.dist)
    check_options(kind, names)
    files = render(kind, names, symbol)
    write_package(directory, files)
    click.echo(f"wrote the {kind} plugin {name!r} ({names.dist}) to {directory}:")
    for path in sorted(files):
        click.echo(f"    {path}")
    click.echo(f"next: pip install -e '{directory}[test]' && pytest {directory}")
