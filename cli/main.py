"""The ``plugtron`` command."""

from __future__ import annotations

import click

from .checkpoint_cmd import checkpoint
from .convert import convert
from .data_cmd import data
from .estimate import make_estimate_command
from .evaluate import make_evaluate_command
from .generate import generate
from .options import expand_data_paths
from .plot import plot
from .plugin_new import plugin
from .plugins_cmd import plugins
from .schedule_cmd import schedule
from .topology import topology
from .train import make_train_command

#: Commands whose options depend on the plugins their arguments select: built per invocation.
PLUGIN_AWARE = {"train": make_train_command, "evaluate": make_evaluate_command,
                "estimate": make_estimate_command}


class PlugtronGroup(click.Group):
    """``train`` and ``evaluate`` are built for the arguments they are called with, so that the
    selected plugins' options exist (and only theirs)."""

    def get_command(self, ctx, cmd_name):
        if cmd_name in PLUGIN_AWARE:
            args = getattr(ctx, "_plugtron_args", [])
            return PLUGIN_AWARE[cmd_name](args)
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(PLUGIN_AWARE))

    def resolve_command(self, ctx, args):
        args = [args[0], *expand_data_paths(args[1:])] if args else args
        ctx._plugtron_args = list(args[1:])
        return super().resolve_command(ctx, args)


@click.group(cls=PlugtronGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """plugtron: a Megatron-style trainer built as a small core plus plugins."""


cli.add_command(plugins)
cli.add_command(plugin)
cli.add_command(topology)
cli.add_command(checkpoint)
cli.add_command(convert)
cli.add_command(schedule)
cli.add_command(plot)
cli.add_command(data)
cli.add_command(generate)


def main():
    from plugtron.core.contracts.versions import show_deprecations

    show_deprecations()  # a plugin's use of a replaced name is said, not hidden
    cli()


if __name__ == "__main__":
    main()
