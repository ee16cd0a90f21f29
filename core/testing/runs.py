"""Short training runs on a pool's ranks, and what they report back to the test process.

A run is ``core.training.setup`` + ``train`` on every rank of a world of ``world_size``, with the
config from :func:`~plugtron.testing.config.make_config`. Losses and grad norms are the values the
core reports (reduced over data-parallel ranks and, from the last stage, the pipeline), so rank
0's records speak for the run. Parameters are gathered to full (tp-unsharded) tensors under the
names the checkpoint stores them by, so they compare across layouts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from plugtron.core import checkpoint
from plugtron.core.checkpoint.state import stored_name
from plugtron.core.contracts.hookspecs import hookimpl
from plugtron.core.monitoring.metrics import MetricsLogger
from plugtron.core.parallel.sharding import gather_tensor_parallel, is_expert, tp_split_of
from plugtron.core.training import loop as training
from plugtron.core.training.validate import validate

from .config import make_config, merge_flags, world_size_of
from .pool import DistributedPool

#: Built-in schedule that stands in for a schedule object while ``setup`` runs: it accepts every
#: (pp, vp, microbatches), so the object's own checks are the only ones that matter.
_STAND_IN_SCHEDULE = "gpipe"


@dataclass
class RunResult:
    """What one run reports: ``records`` (one dict per iteration, as the core's metrics give
    them: ``iteration``, ``lm_loss``, ``grad_norm``, ``lr``, ...), ``params`` (full tensors by
    stored name, when gathered) and ``valid_loss`` (one forward-only evaluation after training,
    when asked)."""

    records: list[dict]
    params: dict[str, torch.Tensor] | None = None
    valid_loss: float | None = None

    def series(self, key: str) -> list:
        """One metric over the iterations, e.g. ``series("lm_loss")``."""
        return [r[key] for r in self.records]


class _StepRecorder:
    """Extension plugin that keeps every step's metrics."""

    def __init__(self):
        self.records: list[dict] = []

    @hookimpl
    def plugtron_step_end(self, iteration, metrics):
        self.records.append(dict(metrics))


def gathered_params(run) -> dict[str, torch.Tensor]:
    """This rank's parameters as full tensors by stored name (a collective over tp: every rank
    calls it), those it is the first replica of: dense ones on dp-cp rank 0, expert ones
    (``allreduce = False``, different on each ep rank) on expert-dp rank 0. A tied copy (the
    last stage's output weight) is keyed ``NAME@copy`` so that the caller can check it equals
    the original."""
    out = {}
    p = run.parallel
    for chunk in run.model_chunks:
        chunk.finish_param_sync()
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            key = stored_name(run, name, param)
            if key != name:
                key += "@copy"
            group, tp_rank, _ = tp_split_of(param, p)  # experts: split over etp
            full = gather_tensor_parallel(param, group).float().clone()
            expert = is_expert(param)
            if tp_rank == 0 and (p.edp_rank if expert else p.dp_cp_rank) == 0:
                out[key] = full
    return out


def _rank_train(rank, world_size, flags, plugins=(), schedule=None, stop_at=None,
                gather=False, evaluate=False):
    """One rank of a run (called by the pool in every rank of the world)."""
    config = make_config(flags)
    recorder = _StepRecorder()
    run = training.setup(config, extra_plugins=[recorder, *plugins], schedule=schedule)
    if stop_at is not None:  # end early; data and lr schedule stay those of --train-iters
        run.config.training.train_iters = stop_at
    try:
        checkpoint.load_if_requested(run)
        training.train(run, MetricsLogger(config, rank=1))  # rank != 0: writes nothing
    finally:
        checkpoint.close(run)
    valid = training.evaluate(run) if evaluate else None
    params = gathered_params(run) if gather else None
    return RunResult(recorder.records, params or None, valid)


def merge_rank_params(results: list[RunResult]) -> dict[str, torch.Tensor]:
    """One dict of full parameters from the ranks that kept theirs (one per pipeline stage)."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result.params or {})
    return merged


@contextlib.contextmanager
def pool_for(world_size: int, pool: DistributedPool | None = None):
    """``pool`` when given (it must hold at least ``world_size`` ranks), else a pool of
    ``world_size`` ranks started now and closed on exit."""
    if pool is not None:
        if pool.world_size < world_size:
            raise ValueError(f"this check needs {world_size} ranks; the pool has "
                             f"{pool.world_size}")
        yield pool
        return
    with DistributedPool(world_size) as own:
        yield own


def refuse_before_launch(*runs: tuple[dict, int]) -> None:
    """Each ``(flags, world_size)`` through the CLI's checks before launch, in this process:
    what the CLI refuses at once raises its ``ConfigError`` here before any rank starts, not a
    traceback from every rank."""
    for flags, world_size in runs:
        validate(make_config(flags), world_size)


def train_run(flags: dict, world_size: int | None = None, pool: DistributedPool | None = None,
              *, plugins=(), schedule=None, gather_params: bool = False,
              evaluate: bool = False, stop_at: int | None = None) -> RunResult:
    """Train ``make_config(flags)`` on a world of ``world_size`` ranks and report rank 0's view.

    ``world_size`` defaults to :func:`world_size_of` ``(flags)`` (tp x pp x cp x dp). ``pool``:
    a :class:`DistributedPool` with at least that many ranks (default: one started for this
    call). ``plugins``: extra pluggy plugin objects registered in every rank (picklable: they
    travel to the ranks). ``schedule``: a schedule plugin object used instead of the one the
    flags select (its ``schedule_actions`` is not checked here; see
    ``plugtron.core.pipeline.plan.check_schedule``). ``gather_params``: also return every
    parameter as a full tensor. ``evaluate``: run one forward-only evaluation after training.
    ``stop_at``: stop after that many iterations (with the final ``--save`` when one is set).
    """
    size = world_size or world_size_of(flags)
    if "dp" in merge_flags(flags) and size != world_size_of(flags):
        raise ValueError(f"flags give tp x pp x cp x dp = {world_size_of(flags)} ranks, but "
                         f"world_size is {size}")
    if schedule is not None:
        flags = merge_flags(flags, {"schedule": _STAND_IN_SCHEDULE})
    refuse_before_launch((flags, size))
    with pool_for(size, pool) as p:
        results = p.run(_rank_train, flags, tuple(plugins), schedule, stop_at, gather_params,
                        evaluate, world_size=size)
    first = results[0]
    params = merge_rank_params(results) if gather_params else None
    return RunResult(first.records, params, first.valid_loss)


def train_losses(flags: dict, world_size: int | None = None,
                 pool: DistributedPool | None = None, *, plugins=()) -> list[dict]:
    """Per-iteration records (``lm_loss``, ``grad_norm``, ``lr``, ...) of a short training of
    ``make_config(flags)`` on ``world_size`` ranks (default tp x pp x cp x dp of the flags), as
    rank 0 reports them. See :func:`train_run` for parameters, evaluation and the rest."""
    return train_run(flags, world_size, pool, plugins=plugins).records
