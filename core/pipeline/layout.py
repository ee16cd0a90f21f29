"""Which decoder layers each pipeline chunk holds (Megatron's layer offsets)."""

from __future__ import annotations

from plugtron.core.errors import ConfigError


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
    counts = [None] * pp
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
                 first: int | None = None, last: int | None = None) -> range:
    """0-based global indices of the layers held by chunk ``vp_stage`` on ``pp_rank``.

    Without interleaving a stage holds one contiguous block. With ``vp`` chunks per rank the
    model is cut into ``pp * vp`` virtual stages and virtual stage ``v * pp + p`` lives on rank
    ``p`` as chunk ``v`` (offset ``v*L/vp + p*L/(pp*vp)`` for even splits). Uneven first/last
    stages split their layers evenly over their ``vp`` chunks, as Megatron does.
    """
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
    per_chunk = [c // chunks for c in counts]
    # Virtual stages before this one: all of the earlier chunks, then this chunk's earlier ranks.
    start = v * sum(per_chunk) + sum(per_chunk[:pp_rank])
    return range(start, start + per_chunk[pp_rank])
