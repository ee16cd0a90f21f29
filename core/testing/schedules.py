"""A pipeline schedule plugin cannot deadlock and trains exactly like 1F1B."""

from __future__ import annotations

from plugtron.core.config_flags import section_flag_fields
from plugtron.core.errors import ConfigError, PluginError
from plugtron.core.parallel.context import LOOPED
from plugtron.core.pipeline.plan import check_schedule
from plugtron.core.plugins import registry
from plugtron.core.plugins.options import collect_sections
from plugtron.core.training.validate import apply_schedule_placement

from .compare import assert_records_close, assert_value_close
from .config import canonical, make_config, merge_flags
from .pool import DistributedPool
from .runs import pool_for, train_run


def _schedule_object(schedule):
    """A schedule given by entry-point name is loaded and instantiated like a run's driver."""
    if isinstance(schedule, str):
        try:
            return registry.instantiate(registry.load("schedule", schedule))
        except PluginError as exc:
            raise AssertionError(str(exc)) from None
    return schedule


def _schedule_option_keys(config) -> set[str]:
    """Every spelling (canonical) of the options the config's schedule declares: the reference
    run does not select that schedule, so it must not get them."""
    keys = set()
    for declared in collect_sections(config):
        if declared.plugin.role == "schedule":
            for f in section_flag_fields(declared.section.name, declared.section.cls):
                keys.update(canonical(s) for s in (f.flag, *f.aliases, f.negative, f.name) if s)
    return keys


def assert_schedule_matches_1f1b(schedule, pp: int = 2, vp: int | None = None,
                                 microbatches: int = 4, flags: dict | None = None,
                                 rtol: float = 1e-6, iters: int = 3,
                                 pool: DistributedPool | None = None) -> None:
    """The schedule's action lists are deadlock-free and it trains like the reference.

    ``schedule`` is an entry-point name (group ``plugtron.schedules``) or a schedule plugin
    object (a picklable instance with ``schedule_actions`` and ``forward_backward``, e.g. a
    ``plugtron.core.pipeline.executor.ActionListSchedule`` subclass). First, without starting any
    rank, ``core.schedule_plan.check_schedule`` plays its lists for ``pp`` ranks, ``vp`` chunks
    and ``microbatches`` microbatches, for training and for forward-only (evaluation); lists
    that miss, repeat or misorder an action, or wait on each other forever, fail the check with
    the schedule's own message; the lists are played under the placement the schedule declares
    (hook ``pipeline_placement``; a V-shape schedule gets its two chunks per rank without
    ``vp``). Then it trains ``iters`` iterations on ``pp`` ranks (dp 1) and
    evaluates once (forward-only), against ``1f1b`` (or ``interleaved-1f1b`` when ``vp`` is set)
    on the same layout (plain ``1f1b`` for a V-shape schedule).

    Tolerance (fp32): ``lm_loss``, ``grad_norm`` and the validation loss relative ``rtol``
    (default 1e-6: only the order in which microbatch gradients are summed differs). ``flags``
    adds model options over the kit's tiny defaults, and for a schedule given by name its own
    options (the reference run goes without them); ``num-layers`` must divide by pp x vp.
    """
    named = isinstance(schedule, str)
    flags = merge_flags(flags or {}, {"schedule": schedule} if named else {})
    micro_batch = make_config(flags).training.micro_batch_size
    layout = {"pp": pp, "global-batch-size": microbatches * micro_batch}
    if vp:
        layout["vp"] = vp
    base = merge_flags(flags, layout, {"train-iters": iters})
    config = make_config(base)
    obj = _schedule_object(schedule)
    try:
        placement = apply_schedule_placement(config, obj)
        check_schedule(obj.schedule_actions, pp, config.parallel.virtual_pipeline_model_parallel_size
                       or 1, microbatches, config, placement)
    except ConfigError as exc:
        raise AssertionError(f"schedule {schedule!r} on pp {pp} vp {vp} with {microbatches} "
                             f"microbatches: {exc}") from None
    # A V-shape schedule's chunks are its own (always two): it is compared with plain 1F1B.
    looped_chunks = vp if placement == LOOPED else None
    reference_name = "interleaved-1f1b" if looped_chunks else "1f1b"
    own_options = _schedule_option_keys(config) if named else set()
    reference = {k: v for k, v in base.items()
                 if k not in own_options and (k != "vp" or looped_chunks)}
    with pool_for(pp, pool) as p:
        got = train_run(base, pp, p, schedule=None if named else obj, evaluate=True)
        want = train_run(merge_flags(reference, {"schedule": reference_name}), pp, p,
                         evaluate=True)
    what = f"schedule {schedule!r} against {reference_name} (pp {pp}, vp {vp})"
    assert_records_close(got.records, want.records, rtol, what)
    assert_value_close(got.valid_loss, want.valid_loss, rtol,
                       f"{what}: forward-only validation loss")
