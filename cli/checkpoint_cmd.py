"""``plugtron checkpoint inspect DIR``."""

from __future__ import annotations

import json

import click

from .errors import user_errors


@click.group()
def checkpoint():
    """Look into checkpoints."""


def layout_shown(layout: dict) -> dict:
    """The saved layout without ep and etp when the model has no expert parameters (etp then
    only repeats tp). Checkpoints from before the flag was saved show every key."""
    dense = layout.get("expert_parameters") is False
    return {k: v for k, v in layout.items()
            if k != "expert_parameters" and not (dense and k in ("ep", "etp"))}


@checkpoint.command("inspect")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def inspect(path, as_json):
    """Iteration, the layout it was saved with, config, plugins, and every tensor's global
    shape and dtype. PATH is a checkpoint or a directory of them (the newest complete one)."""
    from plugtron.core.tools.checkpoint_inspect import describe

    info = describe(path)
    if as_json:
        click.echo(json.dumps(info, indent=1, sort_keys=True))
        return
    layout = info["layout"] or {}
    click.echo(f"checkpoint {info['path']}")
    click.echo(f"  iteration {info['iteration']}, consumed samples {info['consumed_samples']}, "
               f"saved {info['saved_at']} by plugtron {info['plugtron_version']}")
    click.echo("  layout: " + " ".join(f"{k}={v}" for k, v in layout_shown(layout).items()))
    click.echo("  contents: " + " ".join(f"{k}={v}" for k, v in (info["contents"] or {}).items()))
    if info.get("source"):
        click.echo(f"  converted from: {info['source']}")
    click.echo("  plugins:")
    for role, plugin in (info["plugins"] or {}).items():
        if role == "extensions":
            names = ", ".join(f"{n} ({p['distribution']} {p['version']})"
                              for n, p in plugin.items())
            click.echo(f"    extensions: {names or 'none'}")
        else:
            click.echo(f"    {role}: {plugin['name']} ({plugin['distribution']} "
                       f"{plugin['version']})")
    click.echo("  config:")
    for section, values in sorted((info["config"] or {}).items()):
        if isinstance(values, dict) and values:
            items = " ".join(f"{k}={v}" for k, v in sorted(values.items()))
            click.echo(f"    {section}: {items}")
    click.echo(f"  tensors ({len(info['tensors'])}, {info['tensor_bytes'] / 2**20:.2f} MiB "
               f"of tensor files):")
    for name, t in info["tensors"].items():
        shape = "x".join(str(s) for s in t["shape"]) or "scalar"
        click.echo(f"    {name:<60} {t['dtype']:<9} {shape}  ({t['pieces']} piece(s))")
