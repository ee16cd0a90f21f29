"""``plugtron estimate <the run's flags>``: memory per rank, without starting a rank
(core/tools/estimate.py; how to read it: docs/performance.md)."""

from __future__ import annotations

import json

import click
from plugtron.core.training.validate import validate

from .errors import user_errors
from .options import config_options
from .train import RunOptions, check_plugins


def make_estimate_command(args: list[str]) -> click.Command:
    """``estimate`` with the options ``train`` would have for ``args``."""
    run = RunOptions(args)

    @run.command(
        click.option("--nproc-per-node", type=click.IntRange(min=1), default=1,
                     show_default=True,
                     help="Ranks on one node (they share its host memory on CPU)."),
        click.option("--world-size", type=click.IntRange(min=1), default=None,
                     help="Ranks in all (default: --nproc-per-node; more for several nodes)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                     show_default=True, help="Where the run trains (kernels, masks, memory)."),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
        config_options(run.declared), user_errors)
    def estimate(config_file, preset, nproc_per_node, world_size, device, as_json, **params):
        """Memory per rank of the run these flags describe (the same flags as train): weights,
        gradients, optimizer state (replicated and distributed), activations per microbatch
        and in flight under the schedule, recompute and backward workspace, in MiB. Starts no
        rank and allocates no weights."""
        from plugtron.core.tools.estimate import available_memory_per_rank, estimate_memory

        config = run.config(params, config_file, preset)
        world = world_size or nproc_per_node
        check_plugins(config)
        validate(config, world)
        cuda = None if device == "auto" else device == "cuda"
        result = estimate_memory(config, world, cuda=cuda)
        import torch

        here = cuda is None or cuda == torch.cuda.is_available()  # this machine is the target
        have = available_memory_per_rank(min(nproc_per_node, world), cuda) if here else None
        if as_json:
            click.echo(json.dumps({
                "world_size": world, "schedule": result.schedule,
                "microbatches": result.microbatches, "available_bytes_per_rank": have,
                "ranks": [dict(vars(r), total=r.total) for r in result.ranks],
                "notes": result.notes}, indent=1))
            return
        click.echo(f"world {world}, schedule {result.schedule}, {result.microbatches} "
                   f"microbatches per step; MiB per rank")
        click.echo(result.table())
        click.echo(result.header_line())
        if have is None:
            click.echo("available per rank: unknown here (--device is not this machine's)")
        else:
            fits = "fits" if result.peak.total <= have else "does NOT fit"
            click.echo(f"available per rank: {have / 2**20:,.0f} MiB ({fits})")
        for note in result.notes:
            click.echo(f"note: {note}")

    return estimate


__all__ = ["make_estimate_command"]
