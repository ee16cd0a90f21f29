"""``plugtron plugins list [--check]`` and ``plugtron plugins check [NAME]``."""

from __future__ import annotations

import click
from plugtron.core.plugins import check as plugin_check
from plugtron.core.plugins import registry

from .errors import UserError

#: Exit status when a check finds problems (the CLI's status for bad input).
PROBLEMS_EXIT = 2


@click.group()
def plugins():
    """Installed plugins."""


@plugins.command("list")
@click.option("--check", is_flag=True,
              help="Import each plugin and check its hooks (as `plugins check`).")
def list_plugins(check):
    """Every entry-point group, every name, its distribution and version."""
    results = dict(plugin_check.check_plugins(plugin_check.installed_plugins())) if check else {}
    failed = False
    listing = {role: registry.available(role) for role in registry.groups()}
    # one column width for every group: long names (interleaved-zero-bubble) stay aligned
    name_width = max((len(i.name) for infos in listing.values() for i in infos), default=8)
    origin_width = max((len(i.origin) for infos in listing.values() for i in infos), default=8)
    for role, group in registry.groups().items():
        infos = listing[role]
        click.echo(f"{group}  ({role})")
        if not infos:
            click.echo("    (none)")
        for info in infos:
            line = f"    {info.name:<{name_width}}  {info.origin:<{origin_width}}"
            problems = results.get(info, [])
            errors = [p for p in problems if not p.warning]
            if check:
                line += f"  FAILED ({len(errors)})" if errors else "  ok"
            line = line.rstrip()
            click.echo(line)
            for problem in problems:
                click.echo(f"        {problem}")
            failed = failed or bool(errors)
    if failed:
        raise SystemExit(PROBLEMS_EXIT)


@plugins.command("check")
@click.argument("names", nargs=-1, metavar="[NAME]...")
def check_plugins(names):
    """Import every installed plugin (or those called NAME...) and check its hooks against the
    hookspecs: unknown or misspelled hook names, hooks not marked @hookimpl, parameters the hook
    does not have, contract hooks a driver does not implement. Exits 2 on any problem; warnings
    (a layer type without activation_bytes) are printed and do not fail it."""
    infos = plugin_check.installed_plugins(names)
    missing = sorted(set(names) - {info.name for info in infos})
    if missing:
        raise UserError(f"no installed plugin is called {', '.join(map(repr, missing))}; "
                        f"`plugtron plugins list` shows those that are")
    if not infos:
        raise UserError("no plugin is installed: pip install plugtron-gpt, or a plugin package")
    results = plugin_check.check_plugins(infos)
    count = warnings = 0
    for info, problems in results:
        errors = [p for p in problems if not p.warning]
        if not errors:
            click.echo(f"ok  {info.role} {info.name!r} ({info.origin})")
        for problem in problems:
            click.echo(str(problem))
        count += len(errors)
        warnings += len(problems) - len(errors)
    click.echo(f"{len(results)} plugin(s) checked, {count} problem(s)"
               + (f", {warnings} warning(s)" if warnings else ""))
    if count:
        raise SystemExit(PROBLEMS_EXIT)
