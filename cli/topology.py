"""``plugtron topology``: every process group of a layout, without starting processes."""

from __future__ import annotations

import json

import click
from plugtron.core.config import TrainConfig
from plugtron.core.parallel.context import rank_groups, stage_owner, validate_sizes
from plugtron.core.plugins.options import with_plugin_sections
from plugtron.core.training.validate import apply_schedule_placement

from .errors import user_errors


@click.command()
@click.option("--world-size", type=int, required=True, help="Number of ranks.")
@click.option("--tensor-model-parallel-size", "--tp", "tp", type=int, default=1)
@click.option("--pipeline-model-parallel-size", "--pp", "pp", type=int, default=1)
@click.option("--virtual-pipeline-model-parallel-size", "--vp", "vp", type=int, default=None)
@click.option("--context-parallel-size", "--cp", "cp", type=int, default=1)
@click.option("--expert-model-parallel-size", "--ep", "ep", type=int, default=1)
@click.option("--expert-tensor-parallel-size", "--etp", "etp", type=int, default=None)
@click.option("--schedule", "schedule_name", default="auto", show_default=True,
              help="Pipeline schedule: its placement of the virtual stages (looped, or a V) "
                   "decides which ranks hold which stages and the embedding group.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def topology(world_size, tp, pp, vp, cp, ep, etp, schedule_name, as_json):
    """Print the process groups Megatron's rank order (tp-cp-ep-dp-pp) gives."""
    validate_sizes(world_size, tp, pp, cp, ep, etp, vp)
    placement, vp = _placement(schedule_name, pp, vp)
    groups = rank_groups(world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, placement=placement)
    sizes = {"tp": tp, "pp": pp, "vp": vp, "cp": cp, "ep": ep, "etp": etp or tp,
             "dp": world_size // (tp * pp * cp), "edp": world_size // ((etp or tp) * ep * pp)}
    stages = {rank: [s for s in range(pp * (vp or 1)) if stage_owner(s, pp, placement)[0] == rank]
              for rank in range(pp)}
    if as_json:
        click.echo(json.dumps({"world_size": world_size, "sizes": sizes,
                               "pipeline_placement": placement,
                               "stages_of_pp_rank": stages, "groups": groups}, indent=1))
        return
    click.echo(f"world size {world_size}: " + " ".join(f"{k}={v}" for k, v in sizes.items()
                                                         if v is not None))
    if pp > 1:
        click.echo(f"pipeline placement {placement}: " + "; ".join(
            f"pp rank {rank} holds stage{'s' if len(s) > 1 else ''} "
            f"{', '.join(map(str, s))}" for rank, s in stages.items()))
    for kind, lists in groups.items():
        click.echo(f"{kind:>15}: " + " ".join(str(g) for g in lists))


def _placement(schedule_name: str, pp: int, vp: int | None) -> tuple[str, int | None]:
    """The placement the schedule declares, and the chunks per rank it implies."""
    config = TrainConfig()
    config.plugins.schedule = schedule_name
    config.parallel.pipeline_model_parallel_size = pp
    config.parallel.virtual_pipeline_model_parallel_size = vp
    with_plugin_sections(config)
    placement = apply_schedule_placement(config)
    return placement, config.parallel.virtual_pipeline_model_parallel_size
