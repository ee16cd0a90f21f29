"""``plugtron schedule show``: a schedule's per-rank actions, bubble and memory, without ranks."""

from __future__ import annotations

import json

import click
from plugtron.core.config import TrainConfig
from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import validate_sizes
from plugtron.core.pipeline.plan import (
    Action,
    bubble_fraction,
    check_schedule,
    idle_in_span,
    peak_stored,
    simulate,
)
from plugtron.core.plugins import registry
from plugtron.core.plugins.options import with_plugin_sections
from plugtron.core.plugins.selection import resolve_schedule
from plugtron.core.training.validate import apply_schedule_placement

from .errors import user_errors
from .options import config_options


def parse_costs(text: str | None) -> tuple[float, float, float]:
    """``--costs F,I,W`` (the combined backward costs ``I + W``); default 1,1,1."""
    if text is None:
        return 1.0, 1.0, 1.0
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or any(v <= 0 for v in values):
        raise ConfigError(f"--costs takes three positive numbers F,I,W, got {text!r}")
    return values  # type: ignore[return-value]


def describe_schedule(name: str, pp: int, vp: int | None, microbatches: int,
                      group_size: int | None = None,
                      costs: tuple[float, float, float] = (1.0, 1.0, 1.0),
                      config: TrainConfig | None = None) -> tuple[dict, list]:
    """The report ``schedule show`` prints, and the simulated timeline (per-rank slots).
    ``costs``: forward, input-gradient and weight-gradient time; a combined ``B`` costs
    ``I + W``. ``config``: the run's config (a schedule's own options, a config file); by
    default one with ``name``, ``pp``, ``vp`` and ``group_size`` and every option's default."""
    if config is None:
        config = TrainConfig()
        config.plugins.schedule = name
        config.parallel.pipeline_model_parallel_size = pp
        config.parallel.virtual_pipeline_model_parallel_size = vp
        config.parallel.microbatch_group_size_per_vp_stage = group_size
        with_plugin_sections(config)  # a plugin schedule reads its own options (defaults)
    validate_sizes(pp, pp=pp, vp=vp)
    if microbatches < 1:
        raise ConfigError(f"--microbatches must be at least 1, got {microbatches}")
    resolved = resolve_schedule(config)
    schedule = registry.instantiate(registry.load("schedule", resolved))
    placement = apply_schedule_placement(config, schedule)
    vp = config.parallel.virtual_pipeline_model_parallel_size  # a V holds two chunks per rank
    per_rank = check_schedule(schedule.schedule_actions, pp, vp or 1, microbatches, config,
                              placement)
    forward_time, input_time, weight_time = costs
    slots = simulate(per_rank, vp or 1, forward_time=forward_time,
                     backward_time=input_time + weight_time, input_time=input_time,
                     weight_time=weight_time, placement=placement)
    makespan = max(s.end for rank in slots for s in rank)
    idle = idle_in_span(slots)
    work = [sum(s.end - s.start for s in rank) for rank in slots]
    report = {
        "schedule": resolved, "pp": pp, "vp": vp, "microbatches": microbatches,
        "pipeline_placement": placement,
        "costs": {"F": forward_time, "I": input_time, "W": weight_time,
                  "B": input_time + weight_time},
        "bubble_fraction": bubble_fraction(slots),
        "makespan": max(s.end for rank in slots for s in rank),
        # the paper's bubble rate: idle inside a rank's own span over its work, worst rank
        "bubble_rate_in_span": max(i / w for i, w in zip(idle, work)),
        "ranks": [{"rank": rank, "actions": [a.to_dict() for a in actions],
                   "peak_stored_activations": peak_stored(actions),
                   "bubble_fraction": 1.0 - work[rank] / makespan,
                   "idle_in_span": idle[rank]}
                  for rank, actions in enumerate(per_rank)],
    }
    return report, slots


def format_report(report: dict) -> str:
    vp = f", vp {report['vp']}" if report["vp"] else ""
    if report.get("pipeline_placement", "looped") != "looped":
        vp += f" ({report['pipeline_placement']}-shape placement)"
    lines = [(f"schedule {report['schedule']}: pp {report['pp']}{vp}, "
              f"{report['microbatches']} microbatches")]
    for rank in report["ranks"]:
        actions = " ".join(str(Action(**a)) for a in rank["actions"])
        lines.append(f"rank {rank['rank']}: {actions}")
    costs = report["costs"]
    lines.append(f"bubble fraction {report['bubble_fraction']:.4f} (forward {costs['F']:g}, "
                 f"backward {costs['B']:g} per chunk; makespan {report['makespan']:g})")
    if any(a["kind"] in ("I", "W") for r in report["ranks"] for a in r["actions"]):
        lines.append(f"split backward: I (input gradient) {costs['I']:g}, W (weight gradients) "
                     f"{costs['W']:g}")
        lines.append("bubble fraction per rank: " + " ".join(
            f"{r['bubble_fraction']:.4f}" for r in report["ranks"]))
    lines.append("idle inside each rank's own span (the paper's bubble, iterations back to "
                 "back): " + " ".join(f"{r['idle_in_span']:g}" for r in report["ranks"])
                 + f"; bubble rate {report['bubble_rate_in_span']:.4f}")
    lines.append("peak stored activations (microbatch-chunks) per rank: "
                 + " ".join(str(r["peak_stored_activations"]) for r in report["ranks"]))
    return "\n".join(lines)


def format_timeline(slots) -> str:
    """The simulated timeline as text, one column per time unit: ``F3`` a forward of microbatch
    3 on a rank's chunk 0, ``f3`` on its chunk 1 (``*3`` on later chunks), ``B``/``b`` a whole
    backward, ``I``/``i`` and ``W``/``w`` its halves; ``..`` idle. A longer action repeats its
    cell. Needs whole-number costs."""
    end = max(s.end for rank in slots for s in rank)
    if any(float(x) != int(x) for rank in slots for s in rank for x in (s.start, s.end)):
        raise ConfigError("--timeline draws one column per time unit: give whole-number --costs")
    width = max(2, len(str(max(s.action.microbatch for rank in slots for s in rank))) + 1)
    lines = []
    for rank, rank_slots in enumerate(slots):
        cells = [".." .ljust(width)] * int(end)
        for slot in rank_slots:
            a = slot.action
            kind = a.kind if a.chunk == 0 else a.kind.lower() if a.chunk == 1 else "*"
            for t in range(int(slot.start), int(slot.end)):
                cells[t] = f"{kind}{a.microbatch}".ljust(width)
        lines.append(f"rank {rank}: " + " ".join(cells).rstrip())
    return "\n".join(lines)


class ScheduleGroup(click.Group):
    """``schedule show`` takes the run's flags (``--config``, a schedule's own options), so it
    is built for the arguments it is called with, like ``train``."""

    def get_command(self, ctx, cmd_name):
        if cmd_name == "show":
            return make_show_command(getattr(ctx, "_plugtron_args", []))
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), "show"})

    def resolve_command(self, ctx, args):
        ctx._plugtron_args = list(args[1:])
        return super().resolve_command(ctx, args)


@click.group(cls=ScheduleGroup)
def schedule():
    """Pipeline schedules."""


def make_show_command(args: list[str]) -> click.Command:
    """``schedule show`` with the options of the plugins ``args`` select (the schedule's own,
    read from flags or ``--config`` as ``train`` reads them)."""
    from .train import RunOptions

    run = RunOptions(args)

    @run.command(
        click.option("--microbatches", "-m", type=int, required=True,
                     help="Microbatches per step on one data-parallel rank."),
        click.option("--costs", default=None, metavar="F,I,W",
                     help="Simulated time of a forward, an input-gradient I and a "
                          "weight-gradient W (a combined backward B costs I + W). Default "
                          "1,1,1."),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
        click.option("--plot", type=click.Path(dir_okay=False), default=None,
                     help="Write the timeline as a PNG."),
        click.option("--timeline", is_flag=True,
                     help="Also print the timeline as text, one column per time unit (chunk 0 "
                          "upper case, chunk 1 lower case, .. idle)."),
        config_options(run.declared), user_errors)
    def show(config_file, preset, microbatches, costs, as_json, plot, timeline, **params):
        """Print each rank's ordered actions, the bubble fraction and peak stored activations
        of the schedule these flags select (--schedule, --pp, --vp and the schedule's own
        options, from flags or --config)."""
        config = run.config(params, config_file, preset)
        p = config.parallel
        report, slots = describe_schedule(
            config.plugins.schedule, p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size, microbatches,
            p.microbatch_group_size_per_vp_stage, parse_costs(costs), config=config)
        picture = format_timeline(slots) if timeline and not as_json else None
        if plot:
            from .schedule_plot import timeline_png

            timeline_png(slots, plot)
        click.echo(json.dumps(report, indent=1) if as_json else format_report(report))
        if picture:
            click.echo(picture)

    return show
