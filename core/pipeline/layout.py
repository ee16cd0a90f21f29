"""Which decoder layers each pipeline chunk holds (Megatron's layer offsets), under the
placement of virtual stages that the schedule chose (``core/parallel/context.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from plugtron.core.errors import ConfigError
from plugtron.core.parallel.context import (
    LOOPED,
    V_SHAPE,
    check_placement,
    stage_owner,
    virtual_stage,
)

#: The placement of the run whose model is being built (set by the one model builder), so that a
#: model plugin that calls ``chunk_layers`` without ``placement`` still builds the right layers.
_BUILDING_FOR: ContextVar[str] = ContextVar("plugtron_building_placement", default=LOOPED)


@contextlib.contextmanager
def building_for(placement: str) -> Iterator[None]:
    """While building a run's model chunks: ``chunk_layers`` defaults to ``placement``."""
    token = _BUILDING_FOR.set(placement)
    try:
        yield
    finally:
        _BUILDING_FOR.reset(token)


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers per pipeline stage: even, or with the first/last stage sizes given and the rest
    split evenly over the middle stages."""
    if first is None and last is None:
        if num_layers % pp:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by --pp {pp}; give "
                              f"--decoder-first/last-pipeline-num-layers for an uneven split")
        return [num_layers // pp] * pp
    if pp < 2:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need --pp > 1")
    for flag, value in (("first", first), ("last", last)):
        if value is not None and not 0 <= value <= num_layers:
            raise ConfigError(f"--decoder-{flag}-pipeline-num-layers {value} must be between 0 "
                              f"and --num-layers {num_layers}")
    counts: list[int | None] = [None] * pp
    rest, middle = num_layers, pp
    if first is not None:
        counts[0], rest, middle = first, rest - first, middle - 1
    if last is not None:
        counts[-1], rest, middle = last, rest - last, middle - 1
    if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
        raise ConfigError(f"{num_layers} layers cannot be split over {pp} stages with "
                          f"first={first}, last={last}: the remaining {rest} layers must divide "
                          f"evenly over the other {middle} stages")
    return [c if c is not None else rest // middle for c in counts]


def chunk_layers(num_layers: int, pp: int, pp_rank: int, vp: int | None, vp_stage: int | None,
                 first: int | None = None, last: int | None = None,
                 placement: str | None = None) -> range:
    """0-based global indices of the layers held by chunk ``vp_stage`` on ``pp_rank``.

    Without interleaving a stage holds one contiguous block. With ``vp`` chunks per rank the
    model is cut into ``pp * vp`` virtual stages and virtual stage ``v * pp + p`` lives on rank
    ``p`` as chunk ``v`` (offset ``v*L/vp + p*L/(pp*vp)`` for even splits). Uneven first/last
    stages split their layers evenly over their ``vp`` chunks, as Megatron does. Under the
    ``v`` placement (``core/parallel/context.py``) the chunk holds the layers of its stage in
    the V. ``placement`` defaults to the one of the run whose model is being built
    (``parallel.pipeline_placement``; looped outside a build).
    """
    if placement is None:
        placement = _BUILDING_FOR.get()
    chunks = vp or 1
    v = vp_stage or 0
    if not 0 <= v < chunks:
        raise ConfigError(f"virtual stage {vp_stage} is outside --vp {chunks}")
    if chunks > 1 and first is None and last is None and num_layers % (pp * chunks):
        raise ConfigError(f"--num-layers {num_layers} is not divisible by --pp {pp} x --vp "
                          f"{chunks} = {pp * chunks}")
    counts = stage_layer_counts(num_layers, pp, first, last)
    if chunks > 1:
        uneven = [(p, c) for p, c in enumerate(counts) if c % chunks]
        if uneven:
            rank, count = uneven[0]
            raise ConfigError(f"pipeline stage {rank} holds {count} layers, which do not split "
                              f"evenly over --vp {chunks} chunks; with "
                              f"--decoder-first/last-pipeline-num-layers every stage's layer "
                              f"count must be divisible by --vp")
    if placement == V_SHAPE and (first is not None or last is not None):
        raise ConfigError("--decoder-first/last-pipeline-num-layers name pipeline ranks, but "
                          "under a V-shape schedule rank 0 holds both the first and the last "
                          "stage; leave them out (every stage then holds the same number)")
    check_placement(placement, pp, chunks)
    per_chunk = [c // chunks for c in counts]
    # The layers of every virtual stage before this one come first.
    stage = virtual_stage(pp_rank, v, pp, placement)
    start = sum(per_chunk[stage_owner(s, pp, placement)[0]] for s in range(stage))
    return range(start, start + per_chunk[pp_rank])
