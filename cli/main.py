"""The ``plugtron`` command."""

from __future__ import annotations

import click

from .checkpoint_cmd import checkpoint
from .convert import convert
from .evaluate import evaluate
from .plugins_cmd import plugins
from .schedule_cmd import schedule
from .topology import topology
from .train import train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """plugtron: a Megatron-style trainer built as a small core plus plugins."""


cli.add_command(train)
cli.add_command(plugins)
cli.add_command(topology)
cli.add_command(checkpoint)
cli.add_command(evaluate)
cli.add_command(convert)
cli.add_command(schedule)


def main():
    cli()


if __name__ == "__main__":
    main()
