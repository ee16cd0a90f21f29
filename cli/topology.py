"""``plugtron topology``: every process group of a layout, without starting processes."""

from __future__ import annotations

import json

import click
from plugtron.core.parallel.context import rank_groups, validate_sizes

from .errors import user_errors


@click.command()
@click.option("--world-size", type=int, required=True, help="Number of ranks.")
@click.option("--tensor-model-parallel-size", "--tp", "tp", type=int, default=1)
@click.option("--pipeline-model-parallel-size", "--pp", "pp", type=int, default=1)
@click.option("--virtual-pipeline-model-parallel-size", "--vp", "vp", type=int, default=None)
@click.option("--context-parallel-size", "--cp", "cp", type=int, default=1)
@click.option("--expert-model-parallel-size", "--ep", "ep", type=int, default=1)
@click.option("--expert-tensor-parallel-size", "--etp", "etp", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def topology(world_size, tp, pp, vp, cp, ep, etp, as_json):
    """Print the process groups Megatron's rank order (tp-cp-ep-dp-pp) gives."""
    validate_sizes(world_size, tp, pp, cp, ep, etp, vp)
    groups = rank_groups(world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    sizes = {"tp": tp, "pp": pp, "vp": vp, "cp": cp, "ep": ep, "etp": etp or tp,
             "dp": world_size // (tp * pp * cp), "edp": world_size // ((etp or tp) * ep * pp)}
    if as_json:
        click.echo(json.dumps({"world_size": world_size, "sizes": sizes, "groups": groups},
                              indent=1))
        return
    click.echo(f"world size {world_size}: " + " ".join(f"{k}={v}" for k, v in sizes.items()
                                                         if v is not None))
    for kind, lists in groups.items():
        click.echo(f"{kind:>15}: " + " ".join(str(g) for g in lists))
