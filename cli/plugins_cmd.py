"""``plugtron plugins list [--check]``."""

from __future__ import annotations

import click
from plugtron.core import registry


@click.group()
def plugins():
    """Installed plugins."""


@plugins.command("list")
@click.option("--check", is_flag=True, help="Import each plugin and report whether it loads.")
def list_plugins(check):
    """Every entry-point group, every name, its distribution and version."""
    failed = 0
    for role, group in registry.GROUPS.items():
        infos = registry.available(role)
        click.echo(f"{group}  ({role})")
        if not infos:
            click.echo("    (none)")
        for info in infos:
            line = f"    {info.name:<20} {info.distribution} {info.version}"
            if check:
                error = registry.check(role, info.name)
                line += "  ok" if error is None else f"  FAILED: {error}"
                failed += error is not None
            click.echo(line)
    if failed:
        raise SystemExit(1)
